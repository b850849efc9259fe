#!/usr/bin/env bash
# Fine-tune on chat data as people keep it: OpenAI-style `messages` (a system prompt and two turns a row), found
# from the columns, loss on every assistant turn. No model named and no GPU: the embedded tiny Qwen3.
#
#   bash examples/chat_messages.sh                       # 2 processes; any ddp-ft train flag may follow
#   bash examples/chat_messages.sh --model-name-or-path ./my-model --max-seq-len 1024
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec ddp-ft train --source "$here/data/meetings_chat.jsonl" --nproc 2 --output-dir runs/chat_messages "$@"

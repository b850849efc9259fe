"""One DPO run of the end-to-end benchmark, launched on 2 processes (``accelerate launch -m
ddp_ft.tools.bench_e2e.dpo``): ``BucketedDPOTrainer`` with the balanced plan or in the stock order, or TRL's own
``DPOTrainer`` with torch DDP, on the same pairs, model and arguments.

The pairs are the benchmark's meetings: the prompt is a meeting's transcript, chosen its own summary, rejected the
next meeting's, so their widths vary as the meetings do (``mixed``: 60 to 256 tokens). Without ``--source`` the
transcripts are the embedded meetings' first 48 words, pairs of near-equal widths (TRL drops a pair whose prompt
alone reaches ``max_length``, so the ``tiny`` data's full transcripts would leave none). The model is the embedded
tiny Qwen3 in 4-bit with LoRA on every linear layer, the reference its adapter disabled; the batch is the tiny
preset's (2 ranks x micro-batch 2 x accumulation 2, sequences cut at 256). ``ThroughputCallback`` writes
``metrics.jsonl`` as on every other configuration; the stock run gets it first in line and nothing else of ddp_ft.
"""

from __future__ import annotations

import argparse
import json

TRAINERS = ("bucketed", "stock")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", choices=TRAINERS, default="bucketed")
    p.add_argument("--no-balance-ranks", dest="balance_ranks", action="store_false", help="the stock order")
    p.add_argument("--source", help="meetings as JSON lines (dialogue, summary); default: the tiny preset's")
    p.add_argument("--max-steps", type=int, default=16)
    p.add_argument("--output-dir", required=True)
    # the benchmark's common flags (ddp_ft.tools.bench_e2e.runs.command): the tiny preset, nothing reported or saved
    p.add_argument("--preset", choices=["tiny"], default="tiny")
    p.add_argument("--report-to", choices=["none"], default="none")
    p.add_argument("--save-every", type=int, choices=[0], default=0)
    args = p.parse_args(argv)
    if args.trainer == "stock" and args.balance_ranks:
        p.error("--trainer stock samples as TRL does: pass --no-balance-ranks")
    return args


def preference_pairs(meetings: list[dict]) -> list[dict]:
    """Each meeting's own summary chosen over the next meeting's."""
    following = meetings[1:] + meetings[:1]
    return [
        {"prompt": f"Summarise the meeting:\n{m['dialogue']}\n", "chosen": m["summary"], "rejected": n["summary"]}
        for m, n in zip(meetings, following, strict=True)
    ]


def build_trainer(args: argparse.Namespace):
    """The run's trainer: ``BucketedDPOTrainer`` or, for ``--trainer stock``, TRL's with ``ThroughputCallback``."""
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, BitsAndBytesConfig

    from ...embedded import tiny_qwen3_and_meetings
    from ...integrations import ThroughputCallback, bucketed

    model_path, tokenizer_path, meetings = tiny_qwen3_and_meetings(n_meetings=160)
    if args.source:
        with open(args.source) as rows:
            meetings = [json.loads(line) for line in rows if line.strip()]
    config = trl.DPOConfig(
        output_dir=args.output_dir,
        use_cpu=not torch.cuda.is_available(),
        model_init_kwargs={"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")},
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=args.max_steps,
        max_length=256,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=0.1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        include_num_input_tokens_seen="non_padding",
    )
    common = dict(
        model=model_path,
        args=config,
        train_dataset=Dataset.from_list(preference_pairs(meetings)),
        processing_class=AutoTokenizer.from_pretrained(tokenizer_path),
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    if args.trainer == "bucketed":
        return bucketed(trl.DPOTrainer)(**common, balance_ranks=args.balance_ranks)
    stock = trl.DPOTrainer(**common)
    stock.callback_handler.callbacks.insert(0, ThroughputCallback(ddp_config={"trainer": "stock-dpo", "ddp": "torch"}))
    return stock


def main(argv: list[str] | None = None) -> None:
    from ...distributed import destroy_distributed, keep_upstream_notices_to_rank_zero

    keep_upstream_notices_to_rank_zero()
    try:
        build_trainer(parse_args(argv)).train()
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()

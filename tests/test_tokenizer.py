"""The embedded tiny tokenizer (deterministic, idempotent, atomic, ChatML) and the ChatML fallback of load_tokenizer."""

import time
from pathlib import Path

import pytest

from ddp_ft.tokenizer import (
    CHATML_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    build_tiny_tokenizer,
    ensure_chat_format,
    load_tokenizer,
)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
QWEN2_TOKENIZER = SHARED_DATA / "qwen2-tokenizer"

CONVERSATION = [{"role": "user", "content": "Summarize: we chose yellow."}, {"role": "assistant", "content": "Yellow."}]
CHATML_TEXT = "<|im_start|>user\nSummarize: we chose yellow.<|im_end|>\n<|im_start|>assistant\nYellow.<|im_end|>\n"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


def test_tiny_tokenizer_builds_fast_deterministically_and_seed_changes_it(tmp_path, tiny_dir):
    start = time.perf_counter()
    again = build_tiny_tokenizer(tmp_path / "again")
    assert time.perf_counter() - start < 10
    assert (again / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    other = build_tiny_tokenizer(tmp_path / "other", seed=1)
    assert (other / "tokenizer.json").read_bytes() != (tiny_dir / "tokenizer.json").read_bytes()


def test_build_is_idempotent_and_leaves_no_temporary_folders(tiny_dir):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    start = time.perf_counter()
    assert build_tiny_tokenizer(tiny_dir) == tiny_dir
    assert time.perf_counter() - start < 0.5  # returned without training
    assert {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()} == before
    assert [p.name for p in tiny_dir.parent.iterdir()] == [tiny_dir.name]


def test_tiny_tokenizer_speaks_chatml_with_single_token_specials_and_right_padding(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    assert tok.chat_template == CHATML_TEMPLATE
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == CHATML_TEXT
    prompt = tok.apply_chat_template(CONVERSATION[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert [tok.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START, IM_END)] == [0, 1, 2]
    assert tok(IM_START + IM_END, add_special_tokens=False)["input_ids"] == [1, 2]
    assert (tok.pad_token, tok.eos_token, tok.padding_side) == (ENDOFTEXT, IM_END, "right")
    assert len(tok) <= 4096


def test_tiny_tokenizer_round_trips_any_text_byte_level(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    text = "Um, the remote's price: 12,50 € — ça va? 遥控器 🙂\n\nNext."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_chatml_fallback_for_template_less_tokenizer_adds_tokens_and_pads_with_eos_when_no_endoftext():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "</s>": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = ensure_chat_format(PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", padding_side="left"))
    assert tok.chat_template == CHATML_TEMPLATE
    assert tok.convert_tokens_to_ids([IM_START, IM_END]) == [3, 4]
    assert (tok.pad_token, tok.padding_side) == ("</s>", "right")


def test_existing_chat_template_and_pad_token_are_kept(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    tok.chat_template = "{{ messages[0]['content'] }}"
    size = len(tok)
    ensure_chat_format(tok)
    assert tok.chat_template == "{{ messages[0]['content'] }}" and len(tok) == size and tok.pad_token == ENDOFTEXT


@pytest.mark.skipif(not QWEN2_TOKENIZER.is_dir(), reason="shared test data (qwen2-tokenizer) not present")
def test_bare_qwen2_vocab_gets_chatml_with_qwen_ids_and_endoftext_padding():
    tok = load_tokenizer(str(QWEN2_TOKENIZER))
    assert tok.chat_template == CHATML_TEMPLATE
    assert tok.convert_tokens_to_ids([ENDOFTEXT, IM_START, IM_END]) == [151643, 151644, 151645]
    assert len(tok) == 151646
    assert (tok.pad_token, tok.padding_side) == (ENDOFTEXT, "right")
    ids = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids == CHATML_TEXT
    encoded = tok(CHATML_TEXT, add_special_tokens=False)["input_ids"]
    assert encoded.count(151644) == 2 and encoded.count(151645) == 2

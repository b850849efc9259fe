"""The embedded tiny tokenizer (deterministic, idempotent, atomic, ChatML), and any tokenizer made ready to train
without a token added: the plain template for one without a chat template, ``--chat-template chatml|plain|PATH``, an
eos/pad fallback or a refusal, and the refusal of a tokenizer larger than the model's embedding naming its cause."""

import time
from pathlib import Path

import pytest

from ddp_ft.training.data import DataSettings
from ddp_ft.training.data.tokenizer import (
    CHATML_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    build_tiny_tokenizer,
    check_vocabulary,
    ensure_chat_format,
    load_tokenizer,
)

from ..helpers.data import QWEN2_TOKENIZER

CONVERSATION = [{"role": "user", "content": "Summarize: we chose yellow."}, {"role": "assistant", "content": "Yellow."}]
CHATML_TEXT = "<|im_start|>user\nSummarize: we chose yellow.<|im_end|>\n<|im_start|>assistant\nYellow.<|im_end|>\n"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


def test_tiny_builds_fast_deterministically_per_seed(tmp_path, tiny_dir):
    start = time.perf_counter()
    again = build_tiny_tokenizer(tmp_path / "again")
    assert time.perf_counter() - start < 10
    assert (again / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    other = build_tiny_tokenizer(tmp_path / "other", seed=1)
    assert (other / "tokenizer.json").read_bytes() != (tiny_dir / "tokenizer.json").read_bytes()


def test_build_is_idempotent_leaving_no_temp_folders(tiny_dir):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    start = time.perf_counter()
    assert build_tiny_tokenizer(tiny_dir) == tiny_dir
    assert time.perf_counter() - start < 0.5  # returned without training
    assert {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()} == before
    assert [p.name for p in tiny_dir.parent.iterdir()] == [tiny_dir.name]


def test_tiny_speaks_chatml_single_token_specials(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    assert tok.chat_template == CHATML_TEMPLATE
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == CHATML_TEXT
    prompt = tok.apply_chat_template(CONVERSATION[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert [tok.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START, IM_END)] == [0, 1, 2]
    assert tok(IM_START + IM_END, add_special_tokens=False)["input_ids"] == [1, 2]
    assert (tok.pad_token, tok.eos_token, tok.padding_side) == (ENDOFTEXT, IM_END, "right")
    assert len(tok) <= 4096


def test_tiny_round_trips_any_text_byte_level(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    text = "Um, the remote's price: 12,50 € — ça va? 遥控器 🙂\n\nNext."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def _word_tokenizer(words: list[str], **special: str):
    """A template-less WordLevel tokenizer over ``words`` (id = position), with the special tokens given."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", **special)


WORDS = ["[UNK]", "hello", "</s>", "Summarize", ":", "we", "chose", "yellow", ".", "Yellow", "#", "Response"]


def test_template_less_gets_plain_template_own_eos():
    tok = _word_tokenizer(WORDS, eos_token="</s>")
    ensure_chat_format(tok)
    assert len(tok) == len(WORDS) and IM_START not in tok.get_vocab()
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == (
        "Summarize: we chose yellow.\n\n### Response:\nYellow.</s>"
    )
    prompt = tok.apply_chat_template(CONVERSATION[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "Summarize: we chose yellow.\n\n### Response:\n"
    assert tok.apply_chat_template(CONVERSATION)["input_ids"][-1] == 2  # the answer ends with the tokenizer's eos
    assert (tok.pad_token, tok.padding_side) == ("</s>", "right")


def test_chatml_refused_for_vocab_missing_its_tokens():
    with pytest.raises(ValueError, match=r"chatml.*has no <\|im_start\|> and no <\|im_end\|>.*--chat-template plain"):
        ensure_chat_format(_word_tokenizer(WORDS, eos_token="</s>"), "chatml")


def test_chatml_plain_or_jinja_replace_own_template(tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    plain = load_tokenizer(str(tiny_dir), "plain")
    assert plain.apply_chat_template(CONVERSATION, tokenize=False).endswith("### Response:\nYellow.<|im_end|>")
    template = tmp_path / "mine.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}")
    assert DataSettings(chat_template=str(template)).chat_template == str(template)
    mine = load_tokenizer(str(tiny_dir), str(template))
    assert mine.apply_chat_template(CONVERSATION, tokenize=False).startswith("user> Summarize")
    bare = AutoTokenizer.from_pretrained(str(tiny_dir))
    bare.chat_template, size = None, len(bare)
    assert ensure_chat_format(bare, "chatml").chat_template == CHATML_TEMPLATE and len(bare) == size


def test_chat_template_refuses_unknown_word_or_file():
    with pytest.raises(ValueError, match=r"chat_template='llama3' \(--chat-template\): neither one of auto, chatml"):
        DataSettings(chat_template="llama3")


def test_missing_eos_takes_vocab_end_token_or_refuses():
    fallback = ensure_chat_format(_word_tokenizer(WORDS))  # no eos, no pad set; "</s>" in the vocabulary
    assert (fallback.eos_token, fallback.pad_token) == ("</s>", "</s>")
    words = [w for w in WORDS if w != "</s>"]
    with pytest.raises(ValueError, match="has no eos token.*set eos_token in its tokenizer_config.json"):
        ensure_chat_format(_word_tokenizer(words))


def test_tokenizer_larger_than_embedding_is_refused():
    check_vocabulary(_word_tokenizer(WORDS), len(WORDS))  # fits: nothing to say
    with pytest.raises(ValueError, match=r"has 12 tokens but the model's embedding only 8 rows.*another model's"):
        check_vocabulary(_word_tokenizer(WORDS), 8)
    added = _word_tokenizer(WORDS)
    added.add_tokens(["<tool>", "<think>"], special_tokens=True)
    with pytest.raises(ValueError, match=r"2 token\(s\) were added.*'<tool>' \(12\), '<think>' \(13\)"):
        check_vocabulary(added, len(WORDS))


def test_existing_chat_template_and_pad_token_are_kept(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    tok.chat_template = "{{ messages[0]['content'] }}"
    size = len(tok)
    ensure_chat_format(tok)
    assert tok.chat_template == "{{ messages[0]['content'] }}" and len(tok) == size and tok.pad_token == ENDOFTEXT


@pytest.mark.skipif(not QWEN2_TOKENIZER.is_dir(), reason="shared test data (qwen2-tokenizer) not present")
def test_bare_qwen2_vocab_gets_chatml_endoftext_pad():
    tok = load_tokenizer(str(QWEN2_TOKENIZER))
    assert tok.chat_template == CHATML_TEMPLATE
    assert tok.convert_tokens_to_ids([ENDOFTEXT, IM_START, IM_END]) == [151643, 151644, 151645]
    assert len(tok) == 151646
    assert (tok.pad_token, tok.padding_side) == (ENDOFTEXT, "right")
    ids = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids == CHATML_TEXT
    encoded = tok(CHATML_TEXT, add_special_tokens=False)["input_ids"]
    assert encoded.count(151644) == 2 and encoded.count(151645) == 2

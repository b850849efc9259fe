"""Tokenizers: the embedded tiny byte-level BPE, and loading any tokenizer with a ChatML fallback.

Every tokenizer leaves here with a chat template, a pad token and right padding, so the data pipeline never
has to ask. A tokenizer without a template (a base model's, or a bare ``vocab.json`` + ``merges.txt``) gets
ChatML, the format Qwen models are fine-tuned in.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from .synthetic import generate_synthetic_meetings

logger = logging.getLogger(__name__)

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Meetings the tiny tokenizer is trained on: ~0.5M words, enough for every word of the synthetic data to become
# one or two tokens, in about 2 s on one core.
_TRAINING_MEETINGS = 600
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _holds_tokenizer(path: Path) -> bool:
    return all((path / name).is_file() for name in _TOKENIZER_FILES)


def build_tiny_tokenizer(path: str | Path, vocab_size: int = 4096, seed: int = 0) -> Path:
    """Train a byte-level BPE on the synthetic meetings and save it as a ``PreTrainedTokenizerFast``, once.

    Special tokens ``<|endoftext|>`` (pad, id 0), ``<|im_start|>`` (1) and ``<|im_end|>`` (2, eos), and the ChatML
    chat template. Byte-level, so any text (real AMI transcripts too) encodes without unknown tokens. The
    vocabulary has at most ``vocab_size`` entries: training stops early when the corpus has no pair left to
    merge, so size a model by ``len(tokenizer)``.

    Idempotent (a folder that already holds a tokenizer is returned as is), atomic (written to a temporary
    sibling folder, then renamed; a concurrent builder that loses the race keeps the winner's) and
    deterministic in ``seed``.

    Args:
        path (str | Path): folder to create.
        vocab_size (int): largest vocabulary, special tokens and the 256 byte symbols included. Default: 4096
        seed (int): seed of the training corpus. Default: 0

    Returns:
        Path: the folder, loadable with ``AutoTokenizer.from_pretrained`` / ``load_tokenizer``.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if _holds_tokenizer(path):
        return path
    if vocab_size < 512:
        raise ValueError(f"vocab_size={vocab_size}: must be >= 512 (256 byte symbols, 3 special tokens, merges).")
    meetings = generate_synthetic_meetings(_TRAINING_MEETINGS, seed)
    corpus = [m[key] for m in meetings for key in ("dialogue", "summary")]
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        padding_side="right",
        chat_template=CHATML_TEMPLATE,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, path)
        except OSError:
            if not _holds_tokenizer(path):  # not a lost race: a non-empty folder that is no tokenizer
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny tokenizer (%d tokens, seed %d) at %s", len(tokenizer), seed, path)
    return path


def _bare_bpe_folder(name_or_path: str) -> bool:
    """A folder with only ``vocab.json`` + ``merges.txt`` (no tokenizer.json / tokenizer_config.json)."""
    folder = Path(name_or_path)
    return (
        folder.is_dir()
        and (folder / "vocab.json").is_file()
        and (folder / "merges.txt").is_file()
        and not any((folder / name).exists() for name in _TOKENIZER_FILES)
    )


def load_tokenizer(name_or_path: str):
    """``AutoTokenizer.from_pretrained`` plus what training needs: a chat template, a pad token, right padding.

    A folder holding only a byte-level BPE ``vocab.json`` + ``merges.txt`` (which ``AutoTokenizer`` cannot place)
    is loaded as a ``Qwen2Tokenizer``. See ``ensure_chat_format`` for the rest.

    Args:
        name_or_path (str): hub id or local folder.

    Returns:
        PreTrainedTokenizerBase: ready for ``tokenize_dataset`` and the collator.
    """
    from transformers import AutoTokenizer

    if _bare_bpe_folder(name_or_path):
        from transformers import Qwen2Tokenizer

        logger.info("%s holds only vocab.json + merges.txt: loading it as a Qwen2 byte-level BPE", name_or_path)
        tokenizer = Qwen2Tokenizer.from_pretrained(name_or_path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    return ensure_chat_format(tokenizer)


def ensure_chat_format(tokenizer):
    """Give ``tokenizer`` a chat template, a pad token and right padding (in place; returned for chaining).

    Without a chat template it gets ``CHATML_TEMPLATE``, and ``<|im_start|>`` / ``<|im_end|>`` are added as special
    tokens if the vocabulary lacks them (for the Qwen2 vocabulary they get Qwen's ids, 151644 and 151645; the
    model's embedding must cover ``len(tokenizer)``). ``eos_token`` is kept if set (generation should also stop
    at ``<|im_end|>``), else set to ``<|im_end|>``. The pad token is kept if set, else ``<|endoftext|>`` if in
    the vocabulary, else eos; labels are padded with -100 separately, so pad == eos never masks the answer's end.
    """
    if not tokenizer.chat_template:
        vocab = tokenizer.get_vocab()
        missing = [token for token in (IM_START, IM_END) if token not in vocab]
        if missing:
            tokenizer.add_tokens(missing, special_tokens=True)
        tokenizer.chat_template = CHATML_TEMPLATE
        if tokenizer.eos_token is None:
            tokenizer.eos_token = IM_END
        logger.warning(
            "%s has no chat template: using the ChatML fallback (added special tokens: %s)",
            tokenizer.name_or_path,
            missing or "none",
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = ENDOFTEXT if ENDOFTEXT in tokenizer.get_vocab() else tokenizer.eos_token
        if tokenizer.pad_token is None:
            raise ValueError(f"{tokenizer.name_or_path}: no pad token, no {ENDOFTEXT!r} and no eos token to pad with.")
    tokenizer.padding_side = "right"
    return tokenizer

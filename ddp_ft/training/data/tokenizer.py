"""Tokenizers: the embedded tiny byte-level BPE, and any causal LM's tokenizer made ready to train.

Every tokenizer leaves here with a chat template, a pad token and right padding. No token is ever added:
QLoRA never trains the embedding, so a new token could not be learned.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .synthetic import generate_synthetic_meetings

logger = logging.getLogger(__name__)

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
AUTO, CHATML, PLAIN = "auto", "chatml", "plain"
CHAT_TEMPLATES = (AUTO, CHATML, PLAIN)  # or a Jinja file
PLAIN_SEPARATOR = "\n\n### Response:\n"  # the plain template's generation prompt
# End tokens to try for a tokenizer without eos.
_EOS_CANDIDATES = ("</s>", ENDOFTEXT, "<|end_of_text|>", "<eos>")

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Enough meetings that every synthetic word becomes one or two tokens.
_TRAINING_MEETINGS = 600
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _holds_tokenizer(path: Path) -> bool:
    return all((path / name).is_file() for name in _TOKENIZER_FILES)


def build_tiny_tokenizer(path: str | Path, vocab_size: int = 4096, seed: int = 0) -> Path:
    """Train a byte-level BPE on the synthetic meetings and save it, once.

    Byte-level, so any text encodes without unknown tokens. Training may stop below ``vocab_size``, so size a
    model by ``len(tokenizer)``. Idempotent, atomic (built beside, then renamed) and deterministic in ``seed``.

    Args:
        path (str | Path): folder to create.
        vocab_size (int): largest vocabulary. Default: 4096
        seed (int): seed of the training corpus. Default: 0

    Returns:
        Path: the folder, loadable with ``load_tokenizer``.

    Example:
        >>> tokenizer = load_tokenizer(str(build_tiny_tokenizer("/tmp/tiny-tok")))
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
        tmp.chmod(0o755)
        try:
            os.rename(tmp, path)
        except OSError:
            if not _holds_tokenizer(path):  # a real folder, not a lost race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny tokenizer (%d tokens, seed %d) at %s", len(tokenizer), seed, path)
    return path


def _bare_bpe_folder(name_or_path: str) -> bool:
    """A folder with only ``vocab.json`` and ``merges.txt``."""
    folder = Path(name_or_path)
    return (
        folder.is_dir()
        and (folder / "vocab.json").is_file()
        and (folder / "merges.txt").is_file()
        and not any((folder / name).exists() for name in _TOKENIZER_FILES)
    )


def load_tokenizer(name_or_path: str, chat_template: str = AUTO):
    """``AutoTokenizer.from_pretrained`` plus a chat template, a pad token and right padding.

    A folder with only ``vocab.json`` and ``merges.txt`` loads as a ``Qwen2Tokenizer`` with Qwen's special tokens.

    Args:
        name_or_path (str): hub id or local folder.
        chat_template (str): ``auto``, ``chatml``, ``plain`` or a Jinja file. Default: auto

    Returns:
        PreTrainedTokenizerBase: ready for ``tokenize_dataset`` and the collator.

    Raises:
        ValueError: ``chatml`` without its tokens, or no eos token for the plain template.

    Example:
        >>> tokenizer = load_tokenizer("Qwen/Qwen3-4B")
    """
    from transformers import AutoTokenizer

    if _bare_bpe_folder(name_or_path):
        from transformers import Qwen2Tokenizer

        logger.info("%s holds only vocab.json + merges.txt: loading it as a Qwen2 byte-level BPE", name_or_path)
        tokenizer = Qwen2Tokenizer.from_pretrained(name_or_path)
        tokenizer.add_tokens([t for t in (IM_START, IM_END) if t not in tokenizer.get_vocab()], special_tokens=True)
        tokenizer.chat_template = tokenizer.chat_template or CHATML_TEMPLATE
    else:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    own = bool(tokenizer.chat_template)
    ensure_chat_format(tokenizer, chat_template)
    if not (own and chat_template == AUTO):
        logger.info("chat template: %s", describe_template(tokenizer, chat_template, own))
    return tokenizer


def describe_template(tokenizer, chat_template: str, own: bool) -> str:
    """The template choice in words, for the log."""
    if chat_template == AUTO:
        if own:
            return "the tokenizer's own"
        bos = f"{tokenizer.bos_token} + " if _adds_bos(tokenizer) else ""
        return (
            f"plain ({tokenizer.name_or_path} has no chat template): {bos}instruction + transcript + "
            f"{PLAIN_SEPARATOR!r} + answer + {tokenizer.eos_token}, no token added; --chat-template chooses another"
        )
    return "ChatML (--chat-template chatml)" if chat_template == CHATML else f"--chat-template {chat_template}"


def ensure_chat_format(tokenizer, chat_template: str = AUTO):
    """Give ``tokenizer`` a chat template, eos and pad tokens and right padding, in place.

    ``auto`` keeps the tokenizer's own template, else the plain one. A missing eos falls back to a common end
    token. Labels are padded with -100 separately, so pad == eos never masks an answer's end.

    Raises:
        ValueError: ``chatml`` without its tokens, the plain template without eos, or nothing to pad with.
    """
    vocab = tokenizer.get_vocab()
    if chat_template == CHATML:
        missing = [token for token in (IM_START, IM_END) if token not in vocab]
        if missing:
            raise ValueError(
                f"--chat-template chatml (DataSettings.chat_template): the vocabulary of {tokenizer.name_or_path} "
                f"has no {' and no '.join(missing)}; ddp_ft adds no tokens (QLoRA does not train the embedding). "
                f"Use --chat-template plain (or auto), or a Jinja file written with this tokenizer's own tokens."
            )
        tokenizer.chat_template = CHATML_TEMPLATE
        tokenizer.eos_token = tokenizer.eos_token or IM_END
    elif chat_template not in (AUTO, PLAIN):
        tokenizer.chat_template = Path(chat_template).read_text()
    if tokenizer.eos_token is None:
        _fallback_eos(tokenizer, vocab)
    if chat_template == PLAIN or not tokenizer.chat_template:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"{tokenizer.name_or_path} has no eos token, and the plain chat template ends every answer with it "
                "(so the model learns to stop): set eos_token in its tokenizer_config.json to the token the model "
                "ends a text with, or give --chat-template a Jinja file."
            )
        tokenizer.chat_template = plain_template(tokenizer.bos_token if _adds_bos(tokenizer) else None)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = ENDOFTEXT if ENDOFTEXT in vocab else tokenizer.eos_token
        if tokenizer.pad_token is None:
            raise ValueError(
                f"{tokenizer.name_or_path}: no pad token, no {ENDOFTEXT!r} and no eos token to pad with: set "
                "pad_token (or eos_token) in its tokenizer_config.json to a token of its vocabulary."
            )
    tokenizer.padding_side = "right"
    return tokenizer


def plain_template(bos_token: str | None) -> str:
    """A chat template of plain text and the tokenizer's own bos/eos.

    The answer follows ``PLAIN_SEPARATOR``, the generation prompt, and ends with eos.

    Args:
        bos_token (str | None): written first, for tokenizers that start encodings with it. None: nothing.
    """
    separator = json.dumps(PLAIN_SEPARATOR)  # a Jinja string literal
    return (
        ("{{- bos_token }}" if bos_token else "")
        + "{%- for message in messages %}"
        + "{%- if message['role'] == 'assistant' %}{{- "
        + separator
        + " + message['content'] + eos_token }}"
        + "{%- else %}{%- if not loop.first %}{{- '\\n\\n' }}{%- endif %}{{- message['content'] }}{%- endif %}"
        + "{%- endfor %}"
        + "{%- if add_generation_prompt %}{{- "
        + separator
        + " }}{%- endif %}"
    )


def _adds_bos(tokenizer) -> bool:
    """Whether encoding text starts with the bos token."""
    if tokenizer.bos_token_id is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


def _fallback_eos(tokenizer, vocab: dict[str, int]) -> None:
    """Set eos to the first common end token the vocabulary holds."""
    for token in _EOS_CANDIDATES:
        if token in vocab:
            tokenizer.eos_token = token
            logger.info("%s sets no eos token: using %r, its vocabulary's end token", tokenizer.name_or_path, token)
            return


def check_vocabulary(tokenizer, embeddings: int) -> None:
    """Refuse a tokenizer with ids past the model's embedding.

    Either it is another model's tokenizer, or tokens were added after the model was saved.

    Args:
        tokenizer (PreTrainedTokenizerBase): the run's.
        embeddings (int): rows of the model's input embedding.

    Raises:
        ValueError: ``len(tokenizer) > embeddings``, naming the fix.
    """
    size = len(tokenizer)
    if size <= embeddings:
        return
    head = (
        f"the tokenizer of {tokenizer.name_or_path} has {size} tokens but the model's embedding only {embeddings} "
        f"rows (ids {embeddings} to {size - 1} have none; QLoRA trains no embedding rows and ddp_ft adds no tokens)"
    )
    if tokenizer.vocab_size > embeddings:
        raise ValueError(
            f"{head}: its own vocabulary has {tokenizer.vocab_size} tokens, so it is another model's tokenizer. "
            "Train a model with the tokenizer saved beside it: --model-name-or-path a folder (or hub id) holding "
            "both, from the same save_pretrained or download."
        )
    past = sorted((i, t) for t, i in tokenizer.get_added_vocab().items() if i >= embeddings)
    shown = ", ".join(f"{t!r} ({i})" for i, t in past[:5]) + (", ..." if len(past) > 5 else "")
    raise ValueError(
        f"{head}: {len(past)} token(s) were added to the tokenizer after the model was saved: {shown}. Remove them "
        "from its files (added_tokens in tokenizer.json, added_tokens.json), or train a model whose embedding was "
        "resized to hold them (model.resize_token_embeddings, then trained and saved)."
    )

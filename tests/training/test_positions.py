"""A model's table of positions is found in its modules, whatever its config calls it: GPT-2's and OPT's learned
embeddings (OPT's with two rows more), GPT-J's and CodeGen's sine buffers. Rotary models (Llama, Gemma 3) and models
without positions (Jamba) hold none, so nothing is refused for them; a sequence past a table is, naming the fix."""

import pytest
import torch
import transformers

from ddp_ft.training.model.positions import check_generation, check_positions, is_rotary, position_rows

POSITIONS = 40
SMALL = {"vocab_size": 64, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def _tiny(architecture: str) -> torch.nn.Module:
    """A random model of ``architecture`` with 40 positions, two layers and a 64-token vocabulary."""
    gpt = {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": POSITIONS}
    llama = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    configs = {
        "gpt2": lambda: transformers.GPT2Config(**gpt),
        "gptj": lambda: transformers.GPTJConfig(**gpt, rotary_dim=4),
        "codegen": lambda: transformers.CodeGenConfig(**gpt, rotary_dim=4),
        "opt": lambda: transformers.OPTConfig(
            hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=POSITIONS
        ),
        "llama": lambda: transformers.LlamaConfig(**llama, num_key_value_heads=2, max_position_embeddings=POSITIONS),
        "gemma3_text": lambda: transformers.Gemma3TextConfig(
            **llama, num_key_value_heads=2, head_dim=8, max_position_embeddings=POSITIONS
        ),
        "jamba": lambda: transformers.JambaConfig(
            **llama, num_key_value_heads=2, max_position_embeddings=POSITIONS, use_mamba_kernels=False
        ),
    }
    config = configs[architecture]()
    for key, value in SMALL.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    ("architecture", "rows", "rotary"),
    [
        ("gpt2", POSITIONS, False),
        ("opt", POSITIONS, False),
        ("gptj", POSITIONS, False),
        ("codegen", POSITIONS, False),
        ("llama", None, True),
        ("gemma3_text", None, True),  # a rotation per layer type: two buffers
        ("jamba", None, False),
    ],
)
def test_table_of_positions_read_from_the_modules(architecture, rows, rotary):
    model = _tiny(architecture)
    assert (position_rows(model), is_rotary(model)) == (rows, rotary)


@pytest.mark.parametrize("architecture", ["gpt2", "opt", "gptj"])
def test_past_the_table_is_the_index_error_refused(architecture):
    """What is refused is what fails: the table's last position runs, one more raises the error the check prevents."""
    model = _tiny(architecture)
    ids = torch.zeros(1, POSITIONS + 1, dtype=torch.long)
    model(ids[:, :POSITIONS])  # fills the table
    with pytest.raises((IndexError, RuntimeError)):
        model(ids)
    assert check_positions(model, POSITIONS, "--max-seq-len 40", str) is None
    with pytest.raises(ValueError, match=r"--max-seq-len 41: sequences up to 41 tokens long, .* for 40 only\. 40\."):
        check_positions(model, POSITIONS + 1, "--max-seq-len 41", str)
    with pytest.raises(ValueError, match=r"up to 48 positions wide, padding included"):
        check_positions(model, POSITIONS - 1, "--max-seq-len 39", str, padded=48)


def test_rotary_and_positionless_never_refused():
    """Llama's rotary positions run past its trained ones, with a warning; Jamba has no positions to run out of."""
    llama, jamba = _tiny("llama"), _tiny("jamba")
    llama(torch.zeros(1, POSITIONS + 8, dtype=torch.long))  # runs: nothing to refuse
    warning = check_positions(llama, POSITIONS + 8, "--max-seq-len 48", lambda limit: f"Set {limit}")
    assert "48 tokens long, past the 40 positions llama was trained on" in warning and "Set 40" in warning
    assert check_positions(llama, POSITIONS, "--max-seq-len 40", str) is None
    assert check_positions(jamba, POSITIONS + 8, "--max-seq-len 48", str) is None


def test_generation_names_the_new_tokens_that_fit():
    model = _tiny("gpt2")
    assert check_generation(model, 30, 10, "--predict 2") is None
    with pytest.raises(ValueError, match=r"--predict 2 with --max-new-tokens 11, after a prompt of 30 .* 10 or less"):
        check_generation(model, 30, 11, "--predict 2")
    with pytest.raises(ValueError, match="The prompt alone fills them"):
        check_generation(model, 40, 1, "--predict 2")

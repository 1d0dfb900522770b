"""Convert a Gemma 3 GGUF file into a checkpoint directory transformers and we both read.

GGUF stores quantized blocks (Q4_K, Q5_0, Q6_K, Q8_0, ...) under llama.cpp's tensor names, and
Gemma's RMSNorm weights with the +1 already folded in. We dequantize with the `gguf` package,
rename to transformers' Gemma3ForCausalLM keys, undo the +1, and write config.json,
model.safetensors and the tokenizer, so later loads are a plain memory-mapped read.

This runs once per cache, on a server's or `python -m app prepare`'s first start. Each phase is
logged with its duration. The two slow ones are pure Python and bound to one core each (the
`gguf` reader walking 262k vocabulary strings, and transformers rebuilding the BPE merges from
that vocabulary), so the tokenizer is built in a second process while this one reads and
dequantizes the weights.
"""

from __future__ import annotations

import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import structlog
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoTokenizer, Gemma3TextConfig

log = structlog.get_logger(__name__)

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}


def convert_gguf_to_checkpoint(gguf_path: Path, target: Path) -> None:
    """Write config.json, model.safetensors and tokenizer files for `gguf_path` into `target`."""
    # Built in a scratch directory, then moved into place: an interrupted run leaves nothing.
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    spawn = multiprocessing.get_context("spawn")  # no fork of a process that may run threads
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
            tokenizer = pool.submit(write_tokenizer, gguf_path, scratch)
            with _phase("reading GGUF metadata"):
                reader = GGUFReader(str(gguf_path))
                architecture = _field(reader, "general.architecture")
                if architecture != "gemma3":
                    raise ValueError(
                        f"{gguf_path}: GGUF architecture {architecture!r} is not supported"
                    )
                config = _config_from_gguf(reader)
            with _phase("dequantizing weights"):
                weights = _weights_from_gguf(reader)
            with _phase("writing float32 weights"):
                config.save_pretrained(scratch)
                save_file(weights, str(scratch / "model.safetensors"))
            with _phase("tokenizer (built alongside; the wait left)"):
                tokenizer.result()  # started first, in the other process; usually done by now
        if target.exists():
            shutil.rmtree(target)
        scratch.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_tokenizer(gguf_path: Path, directory: Path) -> None:
    """transformers' tokenizer for the GGUF's vocabulary, saved as tokenizer.json."""
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(directory)


@contextmanager
def _phase(name: str) -> Iterator[None]:
    log.info("preparing model", phase=name)
    start = time.perf_counter()
    yield
    log.info("preparing model", phase=name, done_in_s=round(time.perf_counter() - start, 1))


def _field(reader: GGUFReader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise KeyError(f"GGUF metadata has no {key!r}")
    return field.contents()


def _config_from_gguf(reader: GGUFReader) -> Gemma3TextConfig:
    num_layers = int(_field(reader, "gemma3.block_count"))
    # Gemma 3: five sliding-window layers, then one global layer.
    layer_types = [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)
    ]
    head_dim = int(_field(reader, "gemma3.attention.key_length"))
    return Gemma3TextConfig(
        architectures=["Gemma3ForCausalLM"],  # what other readers (vLLM) instantiate
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=int(_field(reader, "gemma3.embedding_length")),
        intermediate_size=int(_field(reader, "gemma3.feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=int(_field(reader, "gemma3.attention.head_count")),
        num_key_value_heads=int(_field(reader, "gemma3.attention.head_count_kv")),
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        rms_norm_eps=float(_field(reader, "gemma3.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_field(reader, "gemma3.context_length")),
        sliding_window=int(_field(reader, "gemma3.attention.sliding_window")),
        layer_types=layer_types,
        rope_parameters={
            "full_attention": {
                "rope_type": "default",
                "rope_theta": float(_field(reader, "gemma3.rope.freq_base")),
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=int(_field(reader, "tokenizer.ggml.padding_token_id")),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        dtype="float32",
    )


def _weights_from_gguf(reader: GGUFReader) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor"):
        name = _hf_name(tensor.name)
        # numpy shape is the reverse of GGUF's ne order, which is already (out, in) for matrices.
        array = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        value = torch.from_numpy(array.reshape([int(n) for n in reversed(tensor.shape)]))
        if name.endswith("norm.weight"):
            value = value - 1.0  # llama.cpp folds Gemma's (1 + w) into the stored weight
        weights[name] = value
    return weights


def _hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    if stem == "output":
        return f"lm_head.{suffix}"
    block, index, kind = stem.split(".", 2)
    if block != "blk" or kind not in _LAYER_TENSORS:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{index}.{_LAYER_TENSORS[kind]}.{suffix}"

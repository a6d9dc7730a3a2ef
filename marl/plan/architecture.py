"""A model's shape, as far as memory goes: read from its `config.json` (a directory, or a Hugging Face id's from the
Hugging Face cache or the Hub), or from a table of well-known models.

`Architecture` holds the numbers the memory plan needs (layers, widths, heads, vocabulary, experts) and derives
the two that everything else scales with: the parameter count and the bytes of keys/values one token occupies in
a KV cache. It covers decoder-only transformers of the Llama / Qwen2 / Qwen3 / Mistral family, dense or
mixture-of-experts (every layer sparse, as in Qwen3-MoE); other shapes are counted as if they were one of those.

`KNOWN_ARCHITECTURES` lets `marl plan` size a well-known model that is not on this machine without the network (a
hub id such as `Qwen/Qwen2.5-7B-Instruct` not in the Hugging Face cache; other ids' config.json is fetched). Its
entries are transcribed from those models' published `config.json` files, and tests build each as a transformers
config on the meta device and check the parameter count against it.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marl.topology.hub_config import HubConfigError, hub_config, is_hub_id

__all__ = ["KNOWN_ARCHITECTURES", "Architecture", "UnknownModel", "architecture_of"]

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "float8_e4m3fn": 1}


class UnknownModel(ValueError):
    """Neither a directory with a config.json, a Hugging Face id whose config.json can be had, nor a model in
    `KNOWN_ARCHITECTURES`."""


@dataclass(frozen=True)
class Architecture:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int | None = None  # None: hidden_size // num_heads
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on q, k and v
    qk_norm: bool = False  # Qwen3 normalises q and k per head
    num_experts: int = 0  # 0: a dense MLP in every layer
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    context_length: int = 4096
    weights_dtype: str = "bfloat16"  # what the checkpoint's files hold

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def q_width(self) -> int:
        return self.num_heads * self.dim_per_head

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.dim_per_head

    @property
    def weights_bytes_per_param(self) -> int:
        return _DTYPE_BYTES.get(self.weights_dtype, 2)

    def layer_attention_params(self) -> int:
        h, q, kv = self.hidden_size, self.q_width, self.kv_width
        bias = q + 2 * kv if self.qkv_bias else 0
        norms = 2 * self.dim_per_head if self.qk_norm else 0
        return h * q + 2 * h * kv + q * h + bias + norms

    def layer_mlp_params(self) -> int:
        h = self.hidden_size
        if self.num_experts:
            return self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts  # experts + router
        return 3 * h * self.intermediate_size  # gate, up, down

    def layer_params(self) -> int:
        return self.layer_attention_params() + self.layer_mlp_params() + 2 * self.hidden_size  # + two RMSNorms

    def embedding_params(self) -> int:
        """Input embeddings, plus the output head when it is not the same matrix."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def parameter_count(self) -> int:
        return self.num_layers * self.layer_params() + self.embedding_params() + self.hidden_size  # + final norm

    def lora_params(self, rank: int, target_modules: tuple[str, ...]) -> int:
        """Parameters of a rank-`rank` LoRA adapter on the named linear layers of every decoder layer: r x (in + out)
        each (a Llama/Qwen decoder's names; an MoE's experts count as one MLP)."""
        h, q, kv, i = self.hidden_size, self.q_width, self.kv_width, self.active_intermediate()
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                  "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip
        return self.num_layers * sum(rank * sum(shapes[m]) for m in target_modules if m in shapes)

    def active_intermediate(self) -> int:
        """MLP width one token runs through: the dense MLP's, or its experts' together."""
        return self.experts_per_token * self.moe_intermediate_size if self.num_experts else self.intermediate_size

    def kv_bytes_per_token(self, bytes_per_value: int, tensor_parallel: int = 1) -> int:
        """Keys and values of one token in every layer, on one of `tensor_parallel` GPUs (KV heads are split over
        them, and replicated when there are fewer heads than GPUs)."""
        heads = max(1, -(-self.num_kv_heads // tensor_parallel))
        return 2 * self.num_layers * heads * self.dim_per_head * bytes_per_value

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str) -> Architecture:
        """From a Hugging Face `config.json` (its text config, for a multimodal model)."""
        config = config.get("text_config") or config
        heads = int(config["num_attention_heads"])
        experts = int(config.get("num_experts") or config.get("n_routed_experts") or 0)
        model_type = str(config.get("model_type", ""))
        return cls(
            name=name, hidden_size=int(config["hidden_size"]), intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads), vocab_size=int(config["vocab_size"]),
            head_dim=config.get("head_dim"), tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", model_type == "qwen2")), qk_norm=model_type.startswith("qwen3"),
            num_experts=experts, experts_per_token=int(config.get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate_size=int(config.get("moe_intermediate_size") or 0) if experts else 0,
            context_length=int(config.get("max_position_embeddings") or 4096),
            weights_dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
        )  # fmt: skip


def _qwen25(name: str, h: int, i: int, layers: int, heads: int, kv: int, *, tied: bool) -> Architecture:
    return Architecture(name=name, hidden_size=h, intermediate_size=i, num_layers=layers, num_heads=heads,
                        num_kv_heads=kv, vocab_size=151936 if tied else 152064, tie_word_embeddings=tied,
                        qkv_bias=True, context_length=32768)  # fmt: skip


#: Well-known models by hub id (lower case), from their published config.json; `marl plan` uses them for a
#: model that is not a directory on this machine.
KNOWN_ARCHITECTURES: dict[str, Architecture] = {
    a.name.lower(): a
    for a in (
        _qwen25("Qwen/Qwen2.5-0.5B-Instruct", 896, 4864, 24, 14, 2, tied=True),
        _qwen25("Qwen/Qwen2.5-1.5B-Instruct", 1536, 8960, 28, 12, 2, tied=True),
        _qwen25("Qwen/Qwen2.5-3B-Instruct", 2048, 11008, 36, 16, 2, tied=True),
        _qwen25("Qwen/Qwen2.5-7B-Instruct", 3584, 18944, 28, 28, 4, tied=False),
        _qwen25("Qwen/Qwen2.5-14B-Instruct", 5120, 13824, 48, 40, 8, tied=False),
        _qwen25("Qwen/Qwen2.5-32B-Instruct", 5120, 27648, 64, 40, 8, tied=False),
        _qwen25("Qwen/Qwen2.5-72B-Instruct", 8192, 29568, 80, 64, 8, tied=False),
        Architecture(name="Qwen/Qwen3-235B-A22B-Instruct-2507", hidden_size=4096, intermediate_size=12288,
                     num_layers=94, num_heads=64, num_kv_heads=4, head_dim=128, vocab_size=151936, qk_norm=True,
                     num_experts=128, experts_per_token=8, moe_intermediate_size=1536, context_length=262144),
        Architecture(name="meta-llama/Llama-3.1-8B-Instruct", hidden_size=4096, intermediate_size=14336,
                     num_layers=32, num_heads=32, num_kv_heads=8, vocab_size=128256, context_length=131072),
        Architecture(name="HuggingFaceTB/SmolLM2-135M-Instruct", hidden_size=576, intermediate_size=1536,
                     num_layers=30, num_heads=9, num_kv_heads=3, vocab_size=49152, tie_word_embeddings=True,
                     context_length=8192),
    )
}
#: marl's own aliases (servers/model_files.py) for the models above.
_ALIASES = {"smollm2-135m": "huggingfacetb/smollm2-135m-instruct"}


def architecture_of(model: str, *, base_dir: Path | None = None, revision: str | None = None) -> Architecture:
    """The architecture of `model`: a directory with a config.json (relative to `base_dir` if given), a Hugging Face
    id (`org/name`, at `revision`) whose config.json is in the Hugging Face cache, a model of `KNOWN_ARCHITECTURES`
    by hub id or alias, or a Hugging Face id whose config.json the Hub gives (fetched into the cache: one small file).
    UnknownModel, in one line saying why and what is known, otherwise."""
    path = Path(model).expanduser()
    if not path.is_absolute() and base_dir is not None and (base_dir / path).exists():
        path = base_dir / path
    if (path / "config.json").is_file():
        return Architecture.from_config(json.loads((path / "config.json").read_text()), name=str(model))
    hub = is_hub_id(model) and not path.exists()
    if hub:
        with contextlib.suppress(HubConfigError):  # not in the cache: the table, else the Hub
            return Architecture.from_config(hub_config(model, revision, cache_only=True), name=model)
    key = _ALIASES.get(model.lower(), model.lower())
    if key in KNOWN_ARCHITECTURES and revision is None:  # the table holds each model's main revision
        return KNOWN_ARCHITECTURES[key]
    known = ", ".join(a.name for a in KNOWN_ARCHITECTURES.values())
    if hub:
        try:
            return Architecture.from_config(hub_config(model, revision), name=model)
        except HubConfigError as exc:
            raise UnknownModel(f"cannot read the shape of {model!r}: {exc}; nor is it a model marl knows the shape"
                               f" of ({known}, smollm2-135m)") from None
    raise UnknownModel(f"{model!r} is neither a model directory with a config.json on this machine, a Hugging Face id"
                       f" (org/name), nor a model marl knows the shape of ({known}, smollm2-135m)")

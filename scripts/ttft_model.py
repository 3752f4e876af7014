"""The model scripts/ttft-bench.py times: a Llama-3.1-8B-shaped decoder in
plain torch with random weights (random weights cost the FLOPs trained ones
do), over a paged KV cache laid out as vLLM's FlashAttention backend lays it
out.

Per layer: RMSNorm, one fused QKV projection, RoPE, attention over the
request's paged K/V (scaled_dot_product_attention where torch has it, the
same arithmetic spelled out where it does not: torch 1.13), the output
projection, RMSNorm and a SwiGLU MLP; then a final RMSNorm and a head over
a small vocabulary (the head's cost is one matrix-vector product for the
last token: its size does not move TTFT).

The kernels are what a serving engine runs, so that a recomputation is
not slower than a real one: RMSNorm is torch's fused rms_norm (torch 2.4
and later; spelled out in fp32 before, as Model.norm_kind says), RoPE is
applied in bf16 with cos and sin cast to bf16, as Hugging Face's Llama
applies it. What remains apart from vLLM: attention reads the request's
K/V gathered out of the paged cache (vLLM's FlashAttention reads the
pages in place), and the QKV and gate/up matrices are plain matmuls (no
torch.compile). A pass of at most 512 tokens (a prompt's suffix after a
cached prefix) runs as vLLM runs it with a KV connector: piecewise CUDA
graphs (Model.capture), one per layer for the part before attention and
one for the part after it, replayed, with attention and the connector's
waits run eagerly between them; longer passes run eagerly, as vLLM runs
a batch larger than its largest capture size.

The cache is one allocation of (layers, 2, num_blocks, block_tokens,
kv_heads, head_dim): cache[l] is layer l's (2, num_blocks, block_tokens,
kv_heads, head_dim) tensor (K and V planes), as vLLM's FlashAttention
backend allocates each layer. The model writes each computed token's K and
V into its block (the request's block table maps token t to block
table[t // block_tokens], row t % block_tokens) and attention reads the
request's K and V back from the blocks (gathered: fine for a benchmark).
"""
import dataclasses
import math

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Config:
    """The model's shape; the defaults are Llama-3.1-8B's (the vocabulary
    excepted: 8192 against 128256)."""
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 14336
    vocab: int = 8192
    block_tokens: int = 16
    rope_theta: float = 500000.0
    eps: float = 1e-5
    window: int = 0  # > 0: every even layer attends to this many tokens (a gpt-oss-like hybrid)

    def windowed(self, layer):
        """Whether layer attends to a sliding window (the even layers of a
        hybrid, as gpt-oss alternates them; none where window is 0)."""
        return self.window > 0 and layer % 2 == 0

    @property
    def block_bytes(self):
        """Bytes of one plane (K or V) of one block of one layer (bf16)."""
        return self.block_tokens * self.kv_heads * self.head_dim * 2

    def kv_bytes(self, tokens):
        """Bytes of tokens' K and V over every layer."""
        return 2 * self.layers * tokens * self.kv_heads * self.head_dim * 2


class Attention:
    """Causal attention of n new queries (positions start..start+n-1) over
    the T = start+n keys before and at them, grouped-query. Probes once
    what this torch offers: scaled_dot_product_attention with a
    lower-right causal bias and enable_gqa (torch >= 2.5: the flash
    kernel), an explicit mask and repeated K/V heads where it lacks those,
    or the arithmetic spelled out (torch 1.13)."""

    def __init__(self, device):
        self.sdpa = getattr(F, "scaled_dot_product_attention", None)
        self.lower_right = None
        self.gqa = False
        if self.sdpa is None:
            self.kind = "matmul softmax (no scaled_dot_product_attention)"
            return
        try:
            from torch.nn.attention.bias import causal_lower_right
            self.lower_right = causal_lower_right
        except ImportError:
            pass
        q = torch.zeros((1, 4, 3, 8), dtype=torch.bfloat16, device=device)
        kv = torch.zeros((1, 2, 5, 8), dtype=torch.bfloat16, device=device)
        try:
            self.sdpa(q, kv, kv, is_causal=True, enable_gqa=True)
            self.gqa = True
        except (TypeError, RuntimeError):
            pass
        if self.lower_right is not None:
            try:
                self._sdpa_offset(q, kv, kv)
            except (TypeError, RuntimeError):
                self.lower_right = None
        self.kind = "scaled_dot_product_attention" + (
            ", lower-right causal bias" if self.lower_right else ", boolean mask after a prefix") + (
            ", enable_gqa" if self.gqa else ", K/V heads repeated")

    def _sdpa_offset(self, q, k, v):
        bias = self.lower_right(q.shape[2], k.shape[2])
        if self.gqa:
            return self.sdpa(q, k, v, attn_mask=bias, enable_gqa=True)
        return self.sdpa(q, k, v, attn_mask=bias)

    def _batched(self, q, k, v):
        """q (n, heads, d), k and v (T, kv_heads, d) as (1, heads, n or T,
        d), k and v repeated per query head where SDPA cannot group them."""
        q, k, v = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if not self.gqa or self.sdpa is None:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return q, k, v

    def __call__(self, q, k, v):
        """q (n, heads, d), k and v (T, kv_heads, d), T >= n: the n queries
        are the last n positions. Returns (n, heads * d)."""
        n, heads, d = q.shape
        t = k.shape[0]
        q, k, v = self._batched(q, k, v)
        if self.sdpa is None:
            scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(d)
            scores = scores.masked_fill(~self._mask(n, t, q.device), float("-inf"))
            out = (scores.softmax(-1) @ v.float()).to(q.dtype)
        elif n == t:
            out = self.sdpa(q, k, v, is_causal=True, **({"enable_gqa": True} if self.gqa else {}))
        elif self.lower_right is not None:
            out = self._sdpa_offset(q, k, v)
        else:
            out = self.sdpa(q, k, v, attn_mask=self._mask(n, t, q.device),
                            **({"enable_gqa": True} if self.gqa else {}))
        return out[0].transpose(0, 1).reshape(n, heads * d)

    def masked(self, q, k, v, mask):
        """q (n, heads, d), k and v (T, kv_heads, d), mask (n, T) booleans
        (True: query i sees key j). Returns (n, heads * d)."""
        n, heads, d = q.shape
        q, k, v = self._batched(q, k, v)
        if self.sdpa is None:
            scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(d)
            out = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.float()).to(q.dtype)
        else:
            out = self.sdpa(q, k, v, attn_mask=mask, **({"enable_gqa": True} if self.gqa else {}))
        return out[0].transpose(0, 1).reshape(n, heads * d)

    @staticmethod
    def _mask(n, t, device):
        """(n, t) booleans: query i (position t-n+i) sees keys 0..t-n+i."""
        rows = torch.arange(n, device=device)[:, None] + (t - n)
        return torch.arange(t, device=device)[None, :] <= rows


@dataclasses.dataclass
class _Graphs:
    """The piecewise CUDA graphs of a pass of one size (Model.capture):
    its static buffers, and per layer the graph before attention (with
    the q, k and v it leaves) and the graph after it."""
    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    attn: torch.Tensor
    before: list = dataclasses.field(default_factory=list)
    after: list = dataclasses.field(default_factory=list)


class Model:
    """The decoder's weights, bf16 on device, drawn from seed (the same
    weights in every process on the same device type). Each matrix is
    drawn with standard deviation 1/sqrt(fan-in), so activations keep
    their scale through the layers."""

    def __init__(self, cfg, device, seed=0):
        self.cfg, self.device = cfg, torch.device(device)
        g = torch.Generator(device=self.device).manual_seed(seed)
        c = cfg
        qkv = (c.heads + 2 * c.kv_heads) * c.head_dim

        def w(rows, cols):
            m = torch.empty((rows, cols), dtype=torch.bfloat16, device=self.device)
            return m.normal_(0.0, 1.0 / math.sqrt(rows), generator=g)
        self.embed = w(c.vocab, c.hidden) * math.sqrt(c.vocab)  # rows of unit scale
        self.layers = [dict(qkv=w(c.hidden, qkv), o=w(c.heads * c.head_dim, c.hidden),
                            gate_up=w(c.hidden, 2 * c.mlp), down=w(c.mlp, c.hidden),
                            ln1=torch.ones(c.hidden, dtype=torch.bfloat16, device=self.device),
                            ln2=torch.ones(c.hidden, dtype=torch.bfloat16, device=self.device))
                       for _ in range(c.layers)]
        self.norm = torch.ones(c.hidden, dtype=torch.bfloat16, device=self.device)
        self.head = w(c.hidden, c.vocab)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.inv_freq = inv.to(self.device)
        self.attention = Attention(self.device)
        self._graphs = {}  # a pass's tokens: its captured graphs (capture)
        self._fused_norm = getattr(F, "rms_norm", None)
        self.norm_kind = "torch rms_norm (fused)" if self._fused_norm else "fp32 spelled out (torch < 2.4)"

    def new_cache(self, num_blocks, alloc=None):
        """A zeroed cache of (layers, 2, num_blocks, block_tokens, kv_heads,
        head_dim) bf16 on the model's device; alloc(shape, dtype), when
        given, makes the tensor instead (host memory the daemon maps)."""
        c = self.cfg
        shape = (c.layers, 2, num_blocks, c.block_tokens, c.kv_heads, c.head_dim)
        if alloc is not None:
            t = alloc(shape, torch.bfloat16)
            t.zero_()
            return t
        return torch.zeros(shape, dtype=torch.bfloat16, device=self.device)

    def _rms(self, x, w):
        if self._fused_norm is not None:
            return self._fused_norm(x, (x.shape[-1],), w, self.cfg.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.eps)).to(x.dtype) * w

    @staticmethod
    def _rope(x, cos, sin):
        """Rotates x's halves by the angles (cos and sin in x's dtype)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    # Window layers' queries go through attention in chunks of this many,
    # each over the keys its window reaches: the mask stays small.
    WINDOW_QUERIES = 2048

    def _window_attention(self, q, layer, table, start, end):
        """Attention of the queries at start..end-1 over the keys of their
        sliding windows (position p sees p - window + 1 .. p), read from
        the blocks of table that hold them: blocks before the first window
        may be vLLM's null block."""
        c, n, w = self.cfg, end - start, self.cfg.window
        out = []
        for qs in range(0, n, self.WINDOW_QUERIES):
            qe = min(n, qs + self.WINDOW_QUERIES)
            first = max(0, start + qs - w + 1)  # the first key any of these queries sees
            b0, b1 = first // c.block_tokens, (start + qe + c.block_tokens - 1) // c.block_tokens
            k0 = b0 * c.block_tokens
            blocks = table[b0:b1]
            keys = layer[0, blocks].reshape(-1, c.kv_heads, c.head_dim)[:start + qe - k0]
            values = layer[1, blocks].reshape(-1, c.kv_heads, c.head_dim)[:start + qe - k0]
            pos = torch.arange(start + qs, start + qe, device=self.device)[:, None]
            kpos = torch.arange(k0, start + qe, device=self.device)[None, :]
            mask = (kpos <= pos) & (kpos > pos - w)
            out.append(self.attention.masked(q[qs:qe], keys, values, mask))
        return torch.cat(out) if len(out) > 1 else out[0]

    def _before_attention(self, i, x, cos, sin):
        """Layer i's part before attention: RMSNorm, the QKV projection and
        RoPE of the residual stream x (n, hidden); returns q, k and v."""
        c, w, n = self.cfg, self.layers[i], x.shape[0]
        qd, kvd = c.heads * c.head_dim, c.kv_heads * c.head_dim
        h = self._rms(x, w["ln1"]) @ w["qkv"]
        q = self._rope(h[:, :qd].view(n, c.heads, c.head_dim), cos, sin)
        k = self._rope(h[:, qd:qd + kvd].view(n, c.kv_heads, c.head_dim), cos, sin)
        return q, k, h[:, qd + kvd:].view(n, c.kv_heads, c.head_dim)

    def _after_attention(self, i, x, attn):
        """Layer i's part after attention, into x in place: the output
        projection of attn, RMSNorm and the MLP, each added to x."""
        w = self.layers[i]
        x.add_(attn @ w["o"])
        gate, up = (self._rms(x, w["ln2"]) @ w["gate_up"]).chunk(2, dim=-1)
        x.add_((F.silu(gate) * up) @ w["down"])

    # vLLM's largest CUDA graph capture size by default: a pass of more
    # tokens runs eagerly.
    MAX_GRAPH_TOKENS = 512

    def capture(self, n):
        """Captures the piecewise CUDA graphs of a pass of n tokens, which
        forward then replays for every pass of n tokens: per layer, the
        part before attention and the part after it, over static buffers
        (the residual stream, RoPE's cos and sin, attention's output), as
        vLLM captures them at start. Returns whether it captured (only on
        CUDA, for 0 < n <= MAX_GRAPH_TOKENS)."""
        if self.device.type != "cuda" or not 0 < n <= self.MAX_GRAPH_TOKENS or n in self._graphs:
            return n in self._graphs
        c, dt = self.cfg, self.embed.dtype
        x = torch.zeros(n, c.hidden, dtype=dt, device=self.device)
        cos = torch.zeros(n, 1, c.head_dim // 2, dtype=dt, device=self.device)
        sin = torch.zeros_like(cos)
        attn = torch.zeros(n, c.heads * c.head_dim, dtype=dt, device=self.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up before capture (cuBLAS's workspaces)
            for i in range(c.layers):
                self._before_attention(i, x, cos, sin)
                self._after_attention(i, x, attn)
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        graphs = _Graphs(x, cos, sin, attn)
        # Captured in the order they are replayed (every pass replays them
        # all, in order): graphs of one pool may then reuse each other's
        # freed intermediates.
        for i in range(c.layers):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                qkv = self._before_attention(i, x, cos, sin)
            graphs.before.append((g, qkv))
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._after_attention(i, x, attn)
            graphs.after.append(g)
        torch.cuda.synchronize()
        self._graphs[n] = graphs
        return True

    def forward(self, tokens, start, cache, table, before_attention=None, after_attention=None, window_table=None):
        """Computes tokens (a 1-D LongTensor on the model's device) at
        positions start.. of a request whose block table is table (a 1-D
        LongTensor of block ids on the device, covering start +
        len(tokens) tokens), writing their K and V into cache, whose
        blocks of positions 0..start-1 must hold the prefix's. Calls
        before_attention(layer) right before a layer writes and reads the
        cache and after_attention(layer) right after (where vLLM's
        attention layers call wait_for_layer_load and save_kv_layer).
        Window layers (cfg.windowed) use window_table where given (their
        KV-cache group's blocks: vLLM's null block 0 before the window),
        else table. A pass of as many tokens as a capture (capture)
        replays its graphs. Returns the last token's logits (float32, on
        the device)."""
        c = self.cfg
        n = tokens.shape[0]
        end = start + n
        pos = torch.arange(start, end, device=self.device)
        ang = pos[:, None].float() * self.inv_freq[None, :]
        dt = self.embed.dtype
        cos, sin = ang.cos()[:, None, :].to(dt), ang.sin()[:, None, :].to(dt)
        blocks, rows = table[pos // c.block_tokens], pos % c.block_tokens
        used = table[:(end + c.block_tokens - 1) // c.block_tokens]
        graphs = self._graphs.get(n)
        if graphs is not None:  # replayed over its static buffers
            graphs.x.copy_(self.embed[tokens])
            graphs.cos.copy_(cos)
            graphs.sin.copy_(sin)
            x = graphs.x
        else:
            x = self.embed[tokens]  # a copy: the layers add into it in place
        for i in range(c.layers):
            if graphs is not None:
                g, (q, k, v) = graphs.before[i]
                g.replay()
            else:
                q, k, v = self._before_attention(i, x, cos, sin)
            if before_attention is not None:
                before_attention(i)
            layer = cache[i]
            if c.windowed(i):
                wt = table if window_table is None else window_table
                wblocks = wt[pos // c.block_tokens]
                layer[0, wblocks, rows] = k
                layer[1, wblocks, rows] = v
                attn = self._window_attention(q, layer, wt, start, end)
            else:
                layer[0, blocks, rows] = k
                layer[1, blocks, rows] = v
                keys = layer[0, used].reshape(-1, c.kv_heads, c.head_dim)[:end]
                values = layer[1, used].reshape(-1, c.kv_heads, c.head_dim)[:end]
                attn = self.attention(q, keys, values)
            if after_attention is not None:
                after_attention(i)
            if graphs is not None:
                graphs.attn.copy_(attn)
                graphs.after[i].replay()
            else:
                self._after_attention(i, x, attn)
        return (self._rms(x[-1:], self.norm) @ self.head)[0].float()

"""The one cost model: roofline time of a prefill per strategy (Meta CP paper 3.4, Table 3, App. A),
which the benchmark prints next to its measurements and `strategy="auto"` minimises.

Per layer and rank, a prefill of T new tokens over P cached ones on N ranks costs
    linear     W T / N * 2 / C_gemm                 (W: weights of one decoder layer's linear maps)
    attention  A = 4 H d T (P + T/2) / N / C_attn    (new token i sees P + i + 1 keys: the causal half of
                                                     the new x new block, App. A's 1/2, plus all of T x P;
                                                     head-tail shards split it evenly)
and the strategies differ in what they send and what overlaps (each strategy's `time` formula, in its
record in `strategies.py`, combines `LayerCost`'s terms; alpha: one message's latency,
BW: ring bandwidth, e: bytes per element, Hkv: KV heads, H: query heads):
    ring_pass_kv   (N-1) max(A/N, alpha + 2 ((T+P)/N) Hkv d e / BW) + A/N           (Alg. 2, overlapped)
    ring_pass_q    (N-1) max(A/N, alpha + (T/N) H d e / BW) + A/N
                   + alpha_a2a + (N-1) (T/N) H (d+1) e_p / BW_a2a                  (Alg. 3 + All2All home;
                                                                                    e_p: the partials' bytes, fp32 here)
    allgather_kv   alpha + (N-1) ((T+P)/N) 2 Hkv d e / BW + A                        (gather, then attend)
    kv_runahead    balanced partitions (the default): every rank the same work, so A, plus the
                   (N-1) hops of the growing prefix chain
    ulysses        2 alpha + ((N-1)/N) (T/N) (H + 2 Hkv) d e / BW + A                 (two All2All, QKV in, O out;
                   N must divide H and Hkv)
                   + ((N-1)/N) (T/N) H d e / BW
(KV-Runahead and Ulysses are modelled for fresh prompts, P = 0.) A sliding layer of window w counts
at most w keys per query (its skipped blocks cost nothing) and holds, so sends, at most w - 1 cached
tokens; a model's total sums its full and sliding layers (`Shape.windows`, from its own cache). Table 3 counts 4 T d (T+P)
FLOPs, i.e. the new x new block in full; its Alg. 1/5 thresholds stay available in `planner`.
Every forward adds `per_forward_collectives` small collectives (input check, logits gather).
Few new tokens: a GPU attention kernel runs tiles of `query_tile` query rows x one head, one per SM
(`compute_units`) at a time, each streaming all of its keys, so a step takes whole waves of tiles:
A is multiplied by waves SMs tile / (H T/N), waves = ceil(H ceil((T/N) / tile) / SMs)
(`Machine.occupancy`; off on CPU).
C_attn is measured on a fully visible block (what the causal FLOP count above divides by),
C_gemm on a matmul the size of the model's MLP, BW and alpha on the running process group.
N = 1 is the unpatched model: L (linear + A).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .machine import Machine
from .strategies import STRATEGIES, Rows


@dataclass
class Shape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    linear_weights: int  # elements of one decoder layer's linear weights (q, k, v, o, MLP)
    elem_bytes: int
    windows: tuple = ()  # per layer: its sliding window, or None (full attention); () = all full
    kv_elems: int = 0  # elements a token's cached K/V holds per layer; 0: K and V of every KV head
    weight_bytes: int = 0  # bytes per weight where they differ from the activations' (FP8 weights); 0: elem_bytes
    partial_bytes: int = 4  # bytes per element of pass-Q's partial outputs sent home (ours: fp32 + LSE)

    @property
    def weight_elem_bytes(self) -> int:
        return self.weight_bytes or self.elem_bytes

    @property
    def kv_token_bytes(self) -> int:
        """Bytes of one token's cached K/V in one layer: what pass-KV moves per token (MLA: the latent)."""
        return (self.kv_elems or 2 * self.kv_heads * self.head_dim) * self.elem_bytes

    @property
    def kv_heads_equivalent(self) -> float:
        """The KV heads of a plain GQA model that would move as many bytes per token (kv_heads but for MLA)."""
        return self.kv_token_bytes / (2 * self.head_dim * self.elem_bytes)

    def window_counts(self) -> dict:
        """{window or None: how many layers}: what every per-layer sum below runs over."""
        counts: dict = {}
        for i in range(self.layers):
            w = self.windows[i] if i < len(self.windows) else None
            counts[w] = counts.get(w, 0) + 1
        return counts


def attended_keys(T: int, P: int = 0, window: int | None = None) -> float:
    """Query-key pairs of T new tokens over P cached ones: new token x (counted continuously from P
    to P + T) sees x keys, or `window` of them on a sliding layer."""
    if window is None or P + T <= window:
        return T * (P + T / 2)
    if P >= window:
        return float(T * window)
    return (window * window - P * P) / 2 + (P + T - window) * window


def kept_keys(P: int, window: int | None) -> int:
    """Cached tokens a layer still holds: all of them, or window - 1 on a sliding layer (as
    transformers' DynamicSlidingWindowLayer and the sharded cache keep)."""
    return P if window is None else min(P, window - 1)


PER_FORWARD_COLLECTIVES = 2  # runtime.py: the input check and the logits gather, one all-gather each


def attention_flops(T: int, shape: Shape, P: int = 0, window: int | None = None) -> float:
    """Causal attention FLOPs of one layer for T new tokens over P cached ones (QK^T and PV):
    new token i sees P + i + 1 keys, so 4 H d T (P + T/2); on a sliding layer at most `window`."""
    return 4.0 * shape.heads * shape.head_dim * attended_keys(T, P, window)


@dataclass(frozen=True)
class LayerCost:
    """One layer's terms for a prefill of T new tokens over P cached ones on N ranks: what every
    strategy's `time` formula (`strategies.py`) combines. A sliding layer (window) skips the blocks
    outside its window (an even share per ring step here) and keeps, so sends, at most window - 1
    cached keys. Each step attends T/N queries of every head, so few new tokens leave the kernel's
    units idle (`Machine.occupancy`)."""

    T: int
    P: int
    N: int
    shape: Shape
    m: Machine
    window: int | None = None
    csa: CsaLayer | None = None  # CSA: its partitions and what each block keeps on this layer
    node: tuple | None = None  # (ranks per node, the Machine of the link inside one): m is the link between nodes

    def hop(self, src: int, dst: int, nbytes: float) -> float:
        """One message from rank src to rank dst: over the node's link where both share a node, else m's."""
        inside = self.node is not None and src // self.node[0] == dst // self.node[0]
        m = self.node[1] if inside else self.m
        return m.latency + nbytes / m.bandwidth

    @property
    def attention(self) -> float:
        """One rank's share of the layer's attention (seconds)."""
        return attention_time(
            attention_flops(self.T, self.shape, self.P, self.window) / self.N, self.T / self.N, self.shape.heads, self.m
        )

    def attend(self, queries: float, before: float) -> float:
        """Seconds for `queries` new tokens after `before` others, each seeing every earlier key."""
        flops = 4.0 * self.shape.heads * self.shape.head_dim * attended_keys(queries, before, self.window)
        return attention_time(flops, queries, self.shape.heads, self.m)

    def message(self, nbytes: float) -> float:
        return self.m.latency + nbytes / self.m.bandwidth

    @property
    def kept(self) -> int:
        return kept_keys(self.P, self.window)

    @property
    def kv_token(self) -> float:  # bytes of one token's cached K/V (MLA: the latent)
        return self.shape.kv_token_bytes

    @property
    def kv_plain(self) -> float:  # one token's K and V over the KV heads
        return 2 * self.shape.kv_heads * self.shape.head_dim * self.shape.elem_bytes

    @property
    def q_token(self) -> float:
        return self.shape.heads * self.shape.head_dim * self.shape.elem_bytes

    @property
    def all2all(self) -> float:
        return all2all_time(self.T, self.N, self.shape, self.m)

    @property
    def latency(self) -> float:
        return self.m.latency

    @property
    def bandwidth(self) -> float:
        return self.m.bandwidth


@dataclass(frozen=True)
class CsaLayer:
    """CSA on one layer: the partition sizes and, per (source, destination) rank, the fraction of the source's
    tokens the destination attends (its level's at a pruning layer, 1 elsewhere)."""

    sizes: list
    fractions: list  # [s][d]

    def kept(self, s: int, d: int) -> int:
        return min(self.sizes[s], math.ceil(self.fractions[s][d] * self.sizes[s]))


def predict_csa(T: int, N: int, shape: Shape, m: Machine, run, node: tuple | None = None) -> tuple[float, float]:
    """(TTFT seconds, attention bytes one rank sends, mean over the ranks) of a fresh prefill under CSA (`run`: a
    sparse.csa.SparseRun for N ranks, its layer indices those of `shape`'s layers) on its default partitions,
    balanced by this model's own terms (`partitions.weighted`). node: (ranks per node, the Machine inside a
    node), m the link between nodes (hierarchical bandwidth); None: m everywhere. Sliding layers run exact, each
    rank's window attention beside one message of the window - 1 columns before its partition; the exact full layers
    (the first and last) keep every key."""
    from .partitions import weighted

    csa, layers = run.csa, shape.layers
    per_token = 2.0 * shape.linear_weights * layers / m.gemm_flops
    per_pair = 4.0 * shape.heads * shape.head_dim * layers / m.attn_flops
    sizes = weighted(T, N, per_token, per_pair, run.pair_weights(N, layers))
    kv_row = shape.kv_token_bytes
    kinds: dict = {}  # (window, prunes) -> layers: the layers of one kind cost the same
    for i in range(layers):
        window = shape.windows[i] if i < len(shape.windows) else None
        prunes = window is None and i not in run.exact and i != run.last
        kinds[window, prunes] = kinds.get((window, prunes), 0) + 1
    total, sent = PER_FORWARD_COLLECTIVES * m.latency, 0.0
    linear = 2.0 * shape.linear_weights * T / N / m.gemm_flops  # balanced: every rank the mean of all work
    for (window, prunes), count in kinds.items():
        if window is not None:  # exact: rank d receives the window - 1 columns before its partition, from d - 1
            c = LayerCost(T, 0, N, shape, m, window, node=node)
            tails = [min(window - 1, sum(sizes[:d])) * kv_row for d in range(1, N)]
            time = max(c.attention, max((c.hop(d, d + 1, b) for d, b in enumerate(tails)), default=0.0))
            nbytes = sum(tails) / N
        else:
            frac = [[csa.fraction(csa.levels(s, d)) if prunes and s < d else 1.0 for d in range(N)] for s in range(N)]
            c = LayerCost(T, 0, N, shape, m, csa=CsaLayer(sizes, frac), node=node)
            rows = [Rows(r, sizes, sizes, kv_row, 0, 0, kept=c.csa.kept) for r in range(N)]
            time, nbytes = STRATEGIES["csa"].time(c), sum(STRATEGIES["csa"].traffic(row)[0] for row in rows) / N
        total, sent = total + count * (linear + time), sent + count * nbytes
    return total, sent


def ring_attention_times(
    T: int, P: int, N: int, shape: Shape, m: Machine, window: int | None = None
) -> tuple[float, float]:
    """One layer's attention with its ring traffic, (ring pass-KV, ring pass-Q) in seconds."""
    c = LayerCost(T, P, N, shape, m, window)
    return STRATEGIES["ring_pass_kv"].time(c), STRATEGIES["ring_pass_q"].time(c)


def attention_time(flops: float, queries: float, heads: int, m: Machine) -> float:
    """Seconds of attention kernels doing `flops` over `queries` rows of `heads` heads per call."""
    return flops / m.attn_flops * m.occupancy(queries, heads)


def all2all_time(T: int, N: int, shape: Shape, m: Machine) -> float:
    """pass-Q's All2All home: every rank sends the N-1 other ranks' partial outputs and LSE."""
    home = (N - 1) * T / N * shape.heads * (shape.head_dim + 1) * shape.partial_bytes
    return m.a2a_latency + home / m.a2a_bandwidth


def model_time(s, T: int, P: int, N: int, shape: Shape, m: Machine) -> float | None:
    """Strategy record s's attention with its traffic, summed over the model's layers (full and sliding ones):
    what strategy="auto" weighs (choice.choose); None where the cost model does not predict it."""
    if s.time is None or not _modelled(s, P, N, shape):
        return None
    total = 0.0
    for window, count in shape.window_counts().items():
        total += count * s.time(LayerCost(T, P, N, shape, m, window))
    return total


def ulysses_fits(heads: int, kv_heads: int, world: int) -> bool:
    """Ulysses moves whole heads: N must divide the query and the KV heads (no KV head is repeated).
    apply_context_parallel refuses other layouts, and the cost model predicts nothing for them."""
    return heads % world == 0 and kv_heads % world == 0


def predict_ttft(strategy: str, T: int, N: int, shape: Shape, m: Machine, P: int = 0) -> float | None:
    """Predicted TTFT (seconds) of a prefill of T tokens over P cached ones; None for a strategy the
    model does not know (KV-Runahead and Ulysses: fresh prompts only)."""
    total = 0.0
    for window, count in shape.window_counts().items():
        attn = _layer_attention(strategy, T, N, shape, m, P, window)
        if attn is None:
            return None
        total += count * (2.0 * shape.linear_weights * T / N / m.gemm_flops + attn)
    return total + (PER_FORWARD_COLLECTIVES * m.latency if N > 1 else 0.0)


def _layer_attention(strategy, T, N, shape, m, P, window) -> float | None:
    """One layer's attention time in a prefill, with the strategy's communication (None: not modelled)."""
    c = LayerCost(T, P, N, shape, m, window)
    if N == 1:  # the unpatched model (a patch on one process changes nothing)
        return c.attention
    s = STRATEGIES.get(strategy)
    if s is None or s.time is None or not _modelled(s, P, N, shape):
        return None
    return s.time(c)


def _modelled(s, P: int, N: int, shape: Shape) -> bool:
    """Does the cost model predict strategy s for P cached tokens on N ranks?"""
    if P and (s.fresh_only or not s.modelled_over_cache):
        return False
    return not s.whole_heads or ulysses_fits(shape.heads, shape.kv_heads, N)


def kv_bytes_per_rank(context: int, N: int, shape: Shape) -> float:
    """After a prefill of `context` tokens: 1/N of what each layer keeps (a sliding layer window - 1)."""
    tokens = sum(count * kept_keys(context, w) for w, count in shape.window_counts().items())
    return 2 * tokens / N * shape.kv_heads * shape.head_dim * shape.elem_bytes


def traffic_per_rank(strategy: str, T: int, P: int, N: int, shape: Shape) -> float | None:
    """Attention bytes one rank sends during a prefill: the strategy's `traffic` formula on an even
    split, averaged over the ranks (the tests check the same formula per rank against the counters)."""
    if N == 1:
        return 0.0
    s = STRATEGIES.get(strategy)
    if s is None or not s.prefill or not _modelled(s, P, N, shape):
        return None
    e, d, h, kv = shape.elem_bytes, shape.head_dim, shape.heads, shape.kv_heads
    total = 0.0
    for w, count in shape.window_counts().items():
        keys = T + kept_keys(P, w)  # what pass-KV and all-gather carry: the new tokens and what the layer kept
        rows = [
            Rows(r, [keys / N] * N, [T / N] * N, 2 * kv * d * e, h * d * e, h * (d + 1) * shape.partial_bytes)
            for r in range(N)
        ]
        total += count * sum(s.traffic(row)[0] for row in rows) / N
    return total


def predict_ttit(context: int, N: int, shape: Shape, m: Machine) -> float:
    """One decode step at `context` tokens, batch 1 (replicated decode): every rank reads the weights
    and its 1/N of each layer's KV cache (memory-bound at batch 1; a sliding layer's window), then
    one small collective per layer."""
    bw = m.memory_bandwidth
    linear = max(2.0 * shape.linear_weights / m.gemm_flops, shape.linear_weights * shape.weight_elem_bytes / bw)
    total = 0.0
    for w, count in shape.window_counts().items():
        keys = kept_keys(context, w) + 1
        attention = max(
            4.0 * shape.heads * shape.head_dim * keys / N / m.attn_flops,
            2 * keys / N * shape.kv_heads * shape.head_dim * shape.elem_bytes / bw,
        )
        total += count * (linear + attention + (m.latency if N > 1 else 0.0))
    return total + (PER_FORWARD_COLLECTIVES * m.latency if N > 1 else 0.0)

"""One rank of the score-bias matrix (tests/*/test_score_bias.py): ALiBi families (BLOOM, MPT, Falcon's alibi=True)
against the unpatched model on one process at a length where the bias dominates (2,048 tokens: the steepest slope,
1/4, puts 512 between the first key's score and the last's), under each prefill strategy, with a left-padded batch
(2 rows, N for batched pass-Q decode, row r with 37 r pads: BLOOM and Falcon count positions over real tokens), greedy decode (replicated or batched pass-Q) and a second turn.
The models are fp64 with their fp32 softmax kept in fp64 (`Fp64Internals`), so 1e-10 is the bound.
Usage: bias_worker.py OUT [family:strategy:decode,...]. Writes OUT/rank{r}.json."""

from __future__ import annotations

import copy
import sys

import torch
from hf_contextpar.eval.oracle import Fp64Internals, logits_diff  # noqa: E402
from records import record_each  # noqa: E402

import hf_contextpar  # noqa: E402

SIZES = dict(num_hidden_layers=2, hidden_size=48, vocab_size=256)
CONFIGS = {  # 6 heads (Ulysses at N = 2, 3; not a power of 2: each family's slopes for the remaining heads)
    "bloom": dict(SIZES, n_head=6),
    "mpt": dict(SIZES, n_heads=6, max_seq_len=4096),
    "falcon": dict(SIZES, num_attention_heads=6, alibi=True, new_decoder_architecture=False, multi_query=False),
    # its per-key bias exp(A * softplus(dt_proj(v))): A ~ N(0, 1) (`model`), top-k beyond 4096 keys
    "doge": dict(SIZES, num_attention_heads=6, num_key_value_heads=3, head_dim=8, keep_window_size=4096),
}
CASES = [
    ("bloom", "ring_pass_kv", "replicated"),
    ("bloom", "ring_pass_q", "ring_pass_q"),
    ("bloom", "allgather_kv", "replicated"),
    ("bloom", "kv_runahead", "ring_pass_q"),
    ("bloom", "ulysses", "replicated"),
    ("mpt", "ring_pass_q", "replicated"),
    ("mpt", "kv_runahead", "ring_pass_q"),
    ("falcon", "allgather_kv", "ring_pass_q"),
    ("falcon", "kv_runahead", "replicated"),
    ("doge", "ring_pass_kv", "ring_pass_q"),
    ("doge", "ring_pass_q", "replicated"),
    ("doge", "kv_runahead", "replicated"),
]
LENGTH, PAD, NEW = 2048, 37, 3


def model(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **CONFIGS[family])
    impl = "sdpa" if family in ("falcon", "doge") else "eager"
    m = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation=impl).eval()
    for name, p in m.named_parameters():
        if name.endswith(".A"):  # Doge's: zero-initialized, a constant bias softmax ignores
            p.data.normal_(generator=torch.Generator().manual_seed(7))
    return m


@torch.no_grad()
def run(m, ids, mask, more):
    """Forward logits, greedy generate, a second turn over the returned cache (as the census's conversation)."""
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    out = {"forward": m(ids, attention_mask=mask).logits}
    first = m.generate(ids, attention_mask=mask, output_logits=True, **gen)
    turn2 = torch.cat([first.sequences, more], 1)
    mask2 = torch.cat([mask, mask.new_ones(turn2.shape[0], turn2.shape[1] - mask.shape[1])], 1)
    second = m.generate(turn2, attention_mask=mask2, cache=first.past_key_values, output_logits=True, **gen)
    out.update(tokens1=first.sequences, logits1=torch.stack(first.logits, 1))
    out.update(tokens2=second.sequences, logits2=torch.stack(second.logits, 1))
    return out


def check(case, rec):
    family, strategy, decode = case.split(":")
    g = torch.Generator().manual_seed(5)
    # batched pass-Q decode: a sequence per rank at least
    rows = max(2, torch.distributed.get_world_size()) if decode == "ring_pass_q" else 2
    ids = torch.randint(3, 256, (rows, LENGTH), generator=g)
    more = torch.randint(3, 256, (rows, 5), generator=g)
    mask = torch.ones_like(ids)
    for r in range(1, rows):
        mask[r, : r * PAD] = 0  # left-padded rows
    base = model(family)
    with Fp64Internals():
        ref = run(copy.deepcopy(base), ids, mask, more)
        hf_contextpar.apply_context_parallel(base, strategy=strategy, decode=decode, timeout=300)
        try:
            ours = run(base, ids, mask, more)
        finally:
            hf_contextpar.remove_context_parallel(base)
    diff = max(
        logits_diff(ours["forward"], ref["forward"], mask),
        *(logits_diff(ours[k], ref[k]) for k in ("logits1", "logits2")),
    )
    tokens = all(torch.equal(ours[k], ref[k]) for k in ("tokens1", "tokens2"))
    rec("exact", max_diff=diff, tokens_equal=tokens)


def main():
    torch.set_num_threads(1)
    cases = sys.argv[2].split(",") if len(sys.argv) > 2 else [":".join(c) for c in CASES]
    hf_contextpar.apply_context_parallel(model("bloom"))  # initialises the process group from the environment
    record_each(sys.argv[1], cases, "case_name", check)


if __name__ == "__main__":
    main()

"""The state chain's wavefront replayed on each rank's CPU time: what a quiet machine (a core per rank) would see.

    torchrun --nproc_per_node 2 dev/chain_replay.py [T] [REPEATS]

On a shared machine a rank's wall time and waits follow the other processes more than the chain. Each rank's
thread CPU time does not: so rank 0 records, per recurrent layer, the CPU time at which its states were final
(the recurrent write: where the chain sends them) and at which the forward moved on (the next layer, an attention
layer's K/V update: where it sent them before issue 44), and at each attention layer's K/V update; rank 1 records
where it needs each. The replay runs rank 1's busy time forward and holds it at each need until rank 0's send:
TTFT = max(rank 0's busy, rank 1's busy + its waits), for both send points, against one process's CPU time.
The bench hybrid (tiny-qwen3_next_hybrid), KV-Runahead's balanced partitions, one thread per rank, the first
prefill a warm-up (the measured-work fit); N = 2 (rank 1 waits on rank 0 alone).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import hf_contextpar
from hf_contextpar.cache import recurrent
from hf_contextpar.models import tiny_model

now = time.thread_time
events: list[tuple[str, int, float]] = []  # (write / leave / need / kv, layer, CPU seconds)


def _record():
    chain, states = recurrent.StateChain, recurrent.ChainedStates
    enter, settle, wrote, update = chain.enter, chain.settle, chain.wrote, states.update
    conv = states.update_conv_state

    def on_enter(self, cache, layer_idx):
        if layer_idx != self.current:
            if self.current is not None:
                events.append(("leave", self.current, now()))
            if self.receive:
                events.append(("need", layer_idx, now()))
        return enter(self, cache, layer_idx)

    def on_settle(self, cache):
        if self.current is not None:
            events.append(("leave", self.current, now()))
        return settle(self, cache)

    def on_wrote(self, cache, layer_idx, recurrent_state):
        if recurrent_state:
            events.append(("write", layer_idx, now()))
        return wrote(self, cache, layer_idx, recurrent_state)

    def on_update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.chain is not None:
            events.append(("kv", layer_idx, now()))
        return update(self, key_states, value_states, layer_idx, *args, **kwargs)

    def on_conv(self, conv_states, layer_idx, *args, **kwargs):
        if self.chain is not None and self.chain.receive:
            events.append(("conv", layer_idx, now()))
        return conv(self, conv_states, layer_idx, *args, **kwargs)

    chain.enter, chain.settle, chain.wrote, states.update = on_enter, on_settle, on_wrote, on_update
    states.update_conv_state = on_conv


def replay(first: dict, second: dict, send_at: str, need_at: str = "need") -> tuple[float, float]:
    """(TTFT, rank 1's waits) when rank 0 sends a layer's states at `send_at` ("write" or "leave") and rank 1
    waits for them at `need_at` ("need": its first touch of the layer; "conv": its conv-state write, after its
    input projections, which a mixer that reads both states first would need a placeholder state for)."""
    ready, kv = {}, {}
    for kind, layer, t in first["events"]:
        if kind == send_at:
            ready.setdefault(layer, t - first["start"])
        if kind == "kv":
            kv.setdefault(layer, t - first["start"])
    clock = prev = waits = 0.0
    for kind, layer, t in second["events"]:
        clock, prev = clock + (t - second["start"] - prev), t - second["start"]
        gate = ready.get(layer) if kind == need_at else kv.get(layer) if kind == "kv" else None
        if gate is not None and gate > clock:
            waits, clock = waits + gate - clock, gate
    clock += second["end"] - second["start"] - prev
    return max(clock, first["end"] - first["start"]), waits


@torch.no_grad()
def main(length: int = 16384, repeats: int = 3):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = tiny_model("qwen3_next_hybrid")
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(0))
    one = None
    if dist.get_rank() == 0:
        start = now()
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        one = now() - start
    dist.barrier()
    hf_contextpar.apply_context_parallel(model, strategy="kv_runahead")
    _record()
    runs = []
    for _ in range(repeats + 1):
        events.clear()
        start = now()
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        runs.append(dict(start=start, end=now(), events=list(events)))
        dist.barrier()
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, runs)
    if dist.get_rank() == 0:
        print(f"one process: {one:.3f} CPU s")
        for i, (first, second) in enumerate(zip(ranks[0][1:], ranks[1][1:])):
            moved, moved_wait = replay(first, second, "leave")
            written, written_wait = replay(first, second, "write")
            late, late_wait = replay(first, second, "write", need_at="conv")
            print(
                f"prefill {i}: busy {first['end'] - first['start']:.3f} / {second['end'] - second['start']:.3f} s; sent "
                f"when the forward moves on {moved:.3f} s (rank 1 waits {moved_wait:.3f}) = {one / moved:.3f}x; at the "
                f"recurrent write {written:.3f} s (waits {written_wait:.3f}) = {one / written:.3f}x; and waited for at "
                f"the conv write {late:.3f} s (waits {late_wait:.3f}) = {one / late:.3f}x"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))

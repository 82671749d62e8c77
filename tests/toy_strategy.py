"""A toy strategy that ships nowhere: ring pass-KV without overlap (each hop's block is waited for
before it is attended). tests/unit/test_algorithms.py::test_a_new_strategy_is_one_file_and_one_record
registers it with one `Strategy` record and runs it through the library's plan, simulated ranks,
traffic formulas and cost model, to show that a strategy needs this file and its record alone."""

from hf_contextpar.attention.kernels import attend
from hf_contextpar.attention.merge import Accumulator
from hf_contextpar.cache.blocks import block_shape


def toy_ring(step, q, kv_local, **attn):
    comm, rank, world = step.comm, step.comm.rank, step.comm.world
    acc, block, src = Accumulator(q.shape[2]), kv_local, rank
    for hop in range(world):
        k, v = step.unpack(block, src)
        attend(q, k, v, step.q_cols, step.kv_cols[src], key_valid=step.key_valid(src), **attn, into=acc)
        if hop < world - 1:
            src = (rank - hop - 1) % world
            block = comm.send_recv(block, block_shape(block, step.kv_size(src))).wait()
            step.received(block, src)  # the cache keeps what this rank commits of it (rebalancing)
    return acc.result() or (None, None)

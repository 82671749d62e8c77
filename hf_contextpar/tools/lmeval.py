"""lm-evaluation-harness with context parallelism: the `hf-cp` model and its launcher.

    torchrun --nproc_per_node 2 -m hf_contextpar lm_eval --model hf-cp \\
        --model_args pretrained=needle-lm,strategy=auto --tasks ... [any lm-eval flag]

`hf-cp` is lm-eval's `hf` model (HFLM: every `hf` model argument works) with
`apply_context_parallel` applied after loading; its own arguments: `strategy`, `decode`, `timeout`
(apply_context_parallel's) and `tp`: tensor parallelism inside groups of `tp` ranks, context
parallelism across them, the weights read already sharded by transformers' TP plan (`mesh.py`, as
`hf_contextpar generate --tp` loads). `csa=KEEP|FILE`, `topology=AxB`, `observe=ROWS`: the approximate
mode, as `--csa` / `--topology` / `--observe` take it elsewhere (per-level fractions joined by ':', since
lm-eval splits --model_args at commas); the run then says, at its start and under its table, that its scores
are approximate, and its results' config carries the settings. lm-eval's `--use_cache` is refused: its request cache is a
database per local rank, so a rank that finds a response there would skip a forward its peers run.
Every rank evaluates every request, one sequence split over all ranks;
lm-eval would otherwise shard the requests over the processes (data parallelism: with the patched
model, each rank would then refuse its peers' different inputs). `cp_size=C` (or accelerate's
PARALLELISM_CONFIG_* environment) splits the processes into replicas of C ranks instead (comm/replicas.py):
lm-eval shards the requests over the replicas, every rank of a replica runs its replica's, and lm-eval's
gathers run between the replicas. Only global rank 0 returns results,
so only it prints and writes --output_path / --log_samples (lm-eval checks LOCAL_RANK alone, which
is 0 on every node). lm-eval loads no plugins by itself, hence the launcher: it registers `hf-cp`,
runs lm-eval's own command line with the arguments after `lm_eval`, then unpatches the models and
tears the process group down before the interpreter exits.
"""

from __future__ import annotations

import inspect
import os
import sys

import torch
import torch.distributed as dist
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ..api import remove_context_parallel
from ..comm.group import DEFAULT_TIMEOUT_S
from ..comm.replicas import Replicas, accelerate_layout, make_groups
from ..models import builtin_model_path

MODEL = "hf-cp"
_models: list = []  # every hf-cp model made in this process, unpatched by the launcher at the end


@register_model(MODEL)
class ContextParallelLM(HFLM):
    """lm-eval's HFLM, patched for exact context parallelism over every process of the launch.

    strategy, decode: apply_context_parallel's (default "auto"). timeout: seconds a rank waits for its
    peers (default 300; the group lm-eval's Accelerator makes waits 52 weeks), through a group of
    hf-contextpar's own. tp: ranks per tensor-parallel group (default 1; it must divide the processes).
    pretrained: anything `hf` takes, or a built-in model name (needle-lm, or tiny-<family> with tp).
    """

    def __init__(
        self,
        pretrained,
        strategy="auto",
        decode="auto",
        timeout=DEFAULT_TIMEOUT_S,
        tp=1,
        cp_size=None,
        csa=None,
        topology=None,
        observe=64,
        **kwargs,
    ):
        import hf_contextpar

        sparse = csa_model_args(csa, topology, observe)  # before the model loads: a bad setting costs nothing
        if kwargs.get("parallelize") or kwargs.get("tp_plan") is not None:
            raise ValueError(
                f"{MODEL}: parallelize / tp_plan do not combine with context parallelism; leave them out "
                "(tensor parallelism: tp=N)."
            )
        if str(kwargs.get("batch_size", 1)).startswith("auto"):
            # the search catches out-of-memory errors, which one rank may meet and its peers not: they would hang
            raise ValueError(f"{MODEL}: --batch_size auto is not supported; give a number (default 1).")
        tp, cp_group = int(tp), None
        layout = _layout(cp_size, tp)  # before the model loads: a layout that does not divide costs nothing
        if tp > 1:  # HFLM takes the loaded model as it is: no Accelerator, no device move
            # TP groups are tp consecutive ranks with or without replicas: the (cp, tp) mesh over the world loads it
            pretrained, tokenizer, cp_group = _load_tp(pretrained, tp, kwargs.get("dtype", "auto"), kwargs)
            kwargs.setdefault("tokenizer", tokenizer)
        elif isinstance(pretrained, str):
            pretrained = builtin_model_path(pretrained) or pretrained
        super().__init__(pretrained=pretrained, **kwargs)
        timeout = None if timeout in (None, "", "none", "None") else float(timeout)
        self.replicas = make_groups(layout, timeout) if layout is not None else None
        if self.replicas is not None:
            cp_group = self.replicas.cp
        hf_contextpar.apply_context_parallel(
            self._model, strategy=strategy, decode=decode, timeout=timeout, group=cp_group, sparse=sparse
        )
        runtime = hf_contextpar.get_runtime(self._model)
        self.cp_world = runtime.world if runtime is not None else 1
        self.approximate = sparse.resolved(self.cp_world).describe() if sparse is not None else None
        if self.approximate and _global_rank() == 0:
            print(approximate_note(self.approximate), flush=True)
        # lm-eval shards the requests over the replicas (one replica: every rank runs every request)
        replica, count = (self.replicas.replica, self.replicas.layout.count) if self.replicas else (0, 1)
        self._rank, self._world_size = replica, count
        self.evaluated: set = set()  # the requests this replica evaluated (said at the end: each by one replica)
        _models.append(self)

    # lm-eval's data parallelism over replicas: its gathers run between the replicas, each rank with its peers
    # of the same place in the other replicas (HFLM's would gather over the whole world, every CP rank twice)
    def all_gather(self, tensor):
        if self.world_size <= 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.replicas.across)
        return torch.cat([p.reshape(-1) if p.dim() == 0 else p for p in parts])

    def gather_object(self, obj, dst=0):
        if self.world_size <= 1:
            return [obj]
        result = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, result, group=self.replicas.across, group_dst=dst)
        return result

    def barrier(self):
        if self.world_size > 1:
            dist.barrier()

    def _count(self, requests) -> None:
        self.evaluated.update((r.task_name, r.doc_id, r.idx) for r in requests)  # lm-eval's padding repeats some

    def replicas_report(self) -> str | None:
        """Global rank 0: which replica evaluated how many requests, and that none was evaluated twice (every
        rank calls it: a gather between the replicas)."""
        if self.world_size <= 1:
            return None
        shares = self.gather_object(sorted(self.evaluated, key=str))
        if _global_rank() != 0:
            return None
        seen = [set(map(tuple, share)) for share in shares]
        twice = sum(len(a & b) for i, a in enumerate(seen) for b in seen[i + 1 :])
        counts = " + ".join(str(len(share)) for share in seen)
        layout = self.replicas.layout
        return (
            f"{MODEL}: {layout.count} replicas of CP {layout.cp} evaluated {counts} = {sum(map(len, seen))} "
            f"requests; {twice} evaluated by more than one replica"
        )

    def loglikelihood(self, requests, *args, **kwargs):
        self._count(requests)
        return super().loglikelihood(requests, *args, **kwargs)

    def loglikelihood_rolling(self, requests, *args, **kwargs):
        self._count(requests)
        return super().loglikelihood_rolling(requests, *args, **kwargs)

    def generate_until(self, requests, *args, **kwargs):
        self._count(requests)
        return super().generate_until(requests, *args, **kwargs)

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["context_parallel_processes"] = self.cp_world
        if self.approximate:  # the results file says what the scores are of
            info["approximate"] = self.approximate
        return info


def csa_model_args(csa=None, topology=None, observe=64):
    """The CSA settings hf-cp's model_args ask for (None: exact). `csa`: a keep fraction, per-level fractions
    joined by ':' (lm-eval cuts --model_args at commas), or a csa-config settings file; `topology` and `observe`
    are settings of `csa` and refused without it. lm-eval hands numbers over as numbers or strings."""
    from ..sparse import CSA

    if csa in (None, ""):
        if topology not in (None, ""):
            raise ValueError(f"{MODEL}: topology is a setting of csa (the approximate mode); add csa=KEEP.")
        return None
    try:
        observe = int(observe)
    except (TypeError, ValueError):
        raise ValueError(f"{MODEL}: observe must be a positive number of query rows, got {observe!r}.") from None
    text = str(csa) if os.path.isfile(str(csa)) else str(csa).replace(":", ",")
    try:
        return CSA.parse(text, str(topology) if topology not in (None, "") else None, observe)
    except ValueError as e:
        raise ValueError(f"{MODEL}: csa={csa!r}: {e}") from None


def approximate_note(describe: str) -> str:
    """The line an approximate run prints: its scores are CSA's, not the model's."""
    return (
        f"{MODEL}: APPROXIMATE run ({describe}): CSA drops distant tokens in prefill; these scores are not the "
        "model's exact ones (leave csa out for those)."
    )


def _load_tp(name: str, tp: int, dtype, kwargs: dict):
    """(model, tokenizer, cp group) of `name` over the (cp, tp) mesh, read sharded (tools/tpload.py),
    on this rank's GPU for a CUDA --device, else the CPU."""
    import torch

    from .tpload import load_tp

    if tp < 1:
        raise ValueError(f"{MODEL}: tp must be a positive number of ranks, got {tp}.")
    cuda = str(kwargs.get("device") or "cuda").startswith("cuda") and torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    if dtype in (None, "auto"):
        dtype = "auto" if not str(name).startswith("tiny-") else torch.float32
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model, tokenizer, cp_group, _ = load_tp(name, tp, dtype, device)
    return model, tokenizer, cp_group


def _layout(cp_size, tp: int):
    """The replicas x CP x TP layout (None: one CP group of every rank, as without it): `cp_size` given, else an
    accelerate parallelism config's (its PARALLELISM_CONFIG_* environment)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cp_size in (None, ""):
        layout = accelerate_layout(world)
        if layout is not None and layout.tp != tp:
            raise ValueError(
                f"{MODEL}: the accelerate parallelism config sets tp_size={layout.tp}; pass tp={layout.tp}."
            )
    else:
        try:
            layout = Replicas.of(world, int(cp_size), tp)
        except (TypeError, ValueError):
            raise ValueError(f"{MODEL}: cp_size must be a positive number of processes, got {cp_size!r}.") from None
    return None if layout is None or layout.count == 1 else layout


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _refuse(model, use_cache) -> None:
    """What `hf_contextpar lm_eval` does not run: another model than hf-cp, or lm-eval's response cache."""
    if model != MODEL and not isinstance(model, ContextParallelLM):
        raise SystemExit(
            f"error: `hf_contextpar lm_eval` runs lm-eval with --model {MODEL}, got --model {model!r}; "
            f"under torchrun, lm-eval's own models shard the requests over the processes (data parallelism)."
        )
    if use_cache is not None:
        raise SystemExit(
            "error: `hf_contextpar lm_eval` does not take --use_cache: lm-eval keeps that response cache in "
            "one database per local rank, so a rank that finds a request there would skip the forward its "
            "peers run for it. Leave --use_cache out."
        )


def _results_on_rank_zero(simple_evaluate):
    """lm-eval's simple_evaluate, run with hf-cp only, returning results on global rank 0 alone: lm-eval's
    command line prints and writes whatever it returns."""

    def run(model=None, *args, **kwargs):
        _refuse(model, inspect.signature(simple_evaluate).bind(model, *args, **kwargs).arguments.get("use_cache"))
        results = simple_evaluate(model, *args, **kwargs)
        return results if _global_rank() == 0 else None

    return run


def main(argv: list[str]) -> None:
    """`python -m hf_contextpar lm_eval ARGS`: lm-eval's command line (`lm_eval ARGS`) with hf-cp."""
    import lm_eval.evaluator
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.utils import setup_logging

    lm_eval.evaluator.simple_evaluate = _results_on_rank_zero(lm_eval.evaluator.simple_evaluate)
    sys.argv = ["lm_eval", *argv]
    setup_logging()  # lm-eval's cli_evaluate, refusing what the command line names before lm-eval's task index
    cli = HarnessCLI()
    args = cli.parse_args()
    if getattr(args, "command", None) == "run":  # a --config file's model and cache: refused in simple_evaluate
        _refuse(MODEL if args.model is None else args.model, args.use_cache)
    # an error propagates: the exit hook tears down what hf-contextpar made, no barrier with a failed peer
    cli.execute(args)
    for lm in _models:
        if (report := lm.replicas_report()) is not None:
            print(report, flush=True)
    for note in sorted({lm.approximate for lm in _models if lm.approximate}):
        if _global_rank() == 0:  # under the table, where a reader looks
            print(approximate_note(note), flush=True)
    for lm in _models:
        remove_context_parallel(lm.model)
    _models.clear()
    if dist.is_initialized():  # the group lm-eval's Accelerator made: ours to tear down, before the interpreter does
        dist.barrier()
        dist.destroy_process_group()

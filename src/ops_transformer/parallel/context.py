"""The rank grid: a frozen :class:`ParallelContext` over a ``DeviceMesh`` with axes ``dp, ep, cp, tp``.

Ranks are laid out ``tp``-fastest: ranks ``0..tp-1`` form the first tensor-parallel group, so TP
groups stay inside a node whenever ``tp`` divides the ranks per node (as in Megatron-LM and
torchtitan): nodes hold consecutive ranks (``torchrun`` numbers them so, and a declared
``ranks_per_node`` means the same). The context owns the process groups and is handed down
explicitly; nothing in the package keeps a process group in a global. It also carries what every
rank agreed on at set-up (:mod:`.nodes`): the ranks per node and the hardware profile from which the
communication engine and every automatic choice decide.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..comm import collectives as C
from ..schema.mesh import check_mesh_degrees  # torch-free, for the checks before any rank
from .nodes import agree_setup, build_engine, resolve_profile_source
from ..launch.rendezvous import job_store
from ..launch.teardown import DEFAULT_TEARDOWN_TIMEOUT_S, destroy_process_groups

MESH_AXES = ("dp", "ep", "tp")
PP_AXIS = "pp"  # outermost, and in the mesh only when pp > 1: stages may span nodes
DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True, eq=False)
class ParallelContext:
    """Where this rank sits in the ``dp × ep × cp × tp`` grid, and the groups along each axis.

    ``cp`` (context parallelism, :mod:`ops_transformer.layers.context_attention`) splits every
    sequence: the ranks of a ``cp`` group read the same rows of the batch, each a part of every
    sequence; dense gradients are averaged over ``dp × ep × cp`` (:attr:`grad_group`).

    A group of ``None`` stands for a group of one rank: every primitive is then the identity, so a
    single process needs no ``torch.distributed`` at all (see :meth:`single`).
    """

    rank: int
    world_size: int
    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int
    ep_size: int = 1
    ep_rank: int = 0
    tp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    dp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    ep_group: dist.ProcessGroup | None = field(default=None, repr=False)
    mesh: object | None = field(default=None, repr=False)  # torch DeviceMesh, or None for one rank
    # The ranks that read different data at one TP rank: dp × ep (dense gradients average here).
    dp_ep_group: dist.ProcessGroup | None = field(default=None, repr=False)
    device: torch.device = torch.device("cpu")
    backend: str | None = None
    owned_group: dist.ProcessGroup | None = field(default=None, repr=False)  # made by init_parallel
    ranks_per_node: int | None = None  # None: every rank on one node
    ranks_per_island: int | None = None  # PCIe islands inside a node; None: one per node
    profile: object | None = field(default=None, repr=False)  # the agreed HardwareProfile
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    # dp × ep × cp flattened (None unless cp > 1): where dense gradients average with cp
    dp_ep_cp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    # dp × cp flattened (None unless cp > 1): the ranks holding the same experts with cp
    dp_cp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    # Pipeline stages (outermost axis): this rank's stage among pp_size, the group of the ranks at
    # this (dp, ep, tp) position in every stage, and their global ranks in stage order.
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    pp_ranks: tuple[int, ...] = ()
    _kv_replica_groups: dict = field(default_factory=dict, init=False, repr=False)
    _pp_end_groups: dict = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> ParallelContext:
        """A one-rank context that needs no process group: every layer runs dense."""
        return cls(rank=0, world_size=1, tp_size=1, tp_rank=0, dp_size=1, dp_rank=0,
                   device=torch.device(device))

    @classmethod
    def from_mesh(cls, mesh, device: torch.device, backend: str | None = None, *,
                  ranks_per_node: int | None = None, profile=None,
                  ranks_per_island: int | None = None) -> ParallelContext:
        """Build the context from a ``DeviceMesh`` whose dimension names include ``tp`` and
        optionally ``dp`` and ``ep``. (Built this way, its collectives all run flat: the engine's
        algorithms are set up by :func:`init_parallel`.)"""
        names = tuple(mesh.mesh_dim_names or ())
        pp_size, pp_rank, pp_group = 1, 0, None
        pp_ranks: tuple[int, ...] = ()
        if PP_AXIS in names:
            pp_size, pp_rank = mesh[PP_AXIS].size(), mesh[PP_AXIS].get_local_rank()
            pp_group = mesh[PP_AXIS].get_group() if pp_size > 1 else None
            pp_ranks = tuple(int(r) for r in mesh[PP_AXIS].mesh.tolist())
        if "tp" not in names:
            raise ValueError(f"the device mesh needs a dimension named 'tp'; it has {names}")

        def axis(name: str):
            if name not in names:
                return 1, 0, None
            sub = mesh[name]
            size = sub.size()
            return size, sub.get_local_rank(), (sub.get_group() if size > 1 else None)

        tp_size, tp_rank, tp_group = axis("tp")
        dp_size, dp_rank, dp_group = axis("dp")
        ep_size, ep_rank, ep_group = axis("ep")
        cp_size, cp_rank, cp_group = axis("cp")
        dp_ep_group = dp_group if ep_size == 1 else ep_group if dp_size == 1 else \
            mesh["dp", "ep"]._flatten("dp_ep").get_group()
        dp_ep_cp_group = dp_cp_group = None
        if cp_size > 1:
            dp_ep_cp_group = cp_group if dp_size * ep_size == 1 else \
                mesh["dp", "ep", "cp"]._flatten("dp_ep_cp").get_group()
            dp_cp_group = cp_group if dp_size == 1 else \
                mesh["dp", "cp"]._flatten("dp_cp").get_group()
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(),
                   tp_size=tp_size, tp_rank=tp_rank, dp_size=dp_size, dp_rank=dp_rank,
                   ep_size=ep_size, ep_rank=ep_rank, tp_group=tp_group, dp_group=dp_group,
                   ep_group=ep_group, mesh=mesh, device=device, backend=backend,
                   dp_ep_group=dp_ep_group, ranks_per_node=ranks_per_node, profile=profile,
                   ranks_per_island=ranks_per_island, cp_size=cp_size, cp_rank=cp_rank,
                   cp_group=cp_group, dp_ep_cp_group=dp_ep_cp_group, dp_cp_group=dp_cp_group,
                   pp_size=pp_size,
                   pp_rank=pp_rank, pp_group=pp_group, pp_ranks=pp_ranks)

    @property
    def grad_group(self) -> dist.ProcessGroup | None:
        """Where dense gradients are averaged: ``dp × ep`` (:attr:`dp_ep_group`), times ``cp``
        when the sequence is split (each ``cp`` rank's gradient covers its part of the tokens)."""
        if self.cp_size > 1:
            return self.dp_ep_cp_group
        return self.dp_ep_group if self.ep_size > 1 else self.dp_group

    @property
    def expert_grad_group(self) -> dist.ProcessGroup | None:
        """Where the experts' gradients are averaged (each EP rank holds its own experts):
        ``dp``, times ``cp`` when the sequence is split (the ``cp`` ranks hold the same experts,
        each its part of the tokens)."""
        return self.dp_cp_group if self.cp_size > 1 else self.dp_group

    @property
    def pp_prev_rank(self) -> int | None:
        """The global rank of the previous stage's rank at this position (``None`` on the first
        stage): where this stage's activations come from and its input gradients go."""
        return self.pp_ranks[self.pp_rank - 1] if self.pp_rank > 0 else None

    @property
    def pp_next_rank(self) -> int | None:
        """The global rank of the next stage's rank at this position (``None`` on the last)."""
        return self.pp_ranks[self.pp_rank + 1] if self.pp_rank + 1 < self.pp_size else None

    @property
    def dp_ep_size(self) -> int:
        """Ranks reading different micro-batches (``dp × ep``): EP ranks hold different experts
        but, like data-parallel ranks, each feeds its own rows of the global batch."""
        return self.dp_size * self.ep_size

    @property
    def dp_ep_rank(self) -> int:
        """This rank's micro-batch among the ``dp × ep`` ones (``dp_rank · ep + ep_rank``)."""
        return self.dp_rank * self.ep_size + self.ep_rank

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """Every rank of the job (``None`` for one process): for what all ranks must agree on,
        such as a skipped step."""
        return dist.group.WORLD if self.world_size > 1 else None

    def data_mesh(self, *, experts: bool = False):
        """The one-dimensional ``DeviceMesh`` of this rank's data-parallel group, a sub-mesh of
        ``mesh``: ``dp × ep`` (flattened) for dense parameters, whose replicas read different
        micro-batches on both axes (``dp × ep × cp`` with context parallelism, whose ranks hold
        the same parameters), ``dp`` for the experts (each EP rank holds its own). FSDP2
        shards parameters over it (:func:`~ops_transformer.memory.fsdp.shard_parameters`)."""
        if self.mesh is None:
            raise ValueError("this context has no device mesh (a single process): there is no "
                             "data-parallel group to shard over")
        if self.cp_size > 1:  # cp ranks hold the same parameters (and experts): × cp
            if experts:
                return self.mesh["cp"] if self.dp_size == 1 else \
                    self.mesh["dp", "cp"]._flatten("dp_cp")  # made once, by from_mesh
            if self.dp_ep_size == 1:
                return self.mesh["cp"]
            return self.mesh["dp", "ep", "cp"]._flatten("dp_ep_cp")  # made once, by from_mesh
        if experts or self.ep_size == 1:
            return self.mesh["dp"]
        if self.dp_size == 1:
            return self.mesh["ep"]
        return self.mesh["dp", "ep"]._flatten("dp_ep")  # made once, by from_mesh

    def kv_replica_group(self, replicas: int) -> dist.ProcessGroup | None:
        """The group of this rank's ``replicas`` consecutive TP ranks, which hold the same KV heads
        when there are fewer KV heads than TP ranks
        (:func:`~ops_transformer.planner.strategies.kv_replicas`): their partial gradients are
        summed over it. ``None`` for one replica. Made on first use, for every TP group at once
        (``new_group`` is collective: every rank asks for the same ``replicas`` in the same
        order, as ``parallelize`` does)."""
        if replicas <= 1:
            return None
        if self.tp_size % replicas:
            raise ValueError(f"replicas ({replicas}) must divide tp ({self.tp_size})")
        if replicas not in self._kv_replica_groups:
            mine = None
            for tp_ranks in self.mesh.mesh.reshape(-1, self.tp_size).tolist():
                for start in range(0, self.tp_size, replicas):
                    ranks = tp_ranks[start:start + replicas]
                    group = dist.new_group(ranks)
                    if self.rank in ranks:
                        mine = group
            self._kv_replica_groups[replicas] = mine
        return self._kv_replica_groups[replicas]

    def pp_ends_group(self) -> dist.ProcessGroup | None:
        """The group of the first and the last stage's ranks at this (dp, ep, tp) position, over
        which a tied embedding's two halves sum their gradients (Megatron-LM's embedding group);
        ``None`` with one stage. The ``pp`` group itself for two stages; for more, made on first
        use for every position at once (``new_group`` is collective: every rank asks)."""
        if self.pp_size <= 1:
            return None
        if self.pp_size == 2:
            return self.pp_group
        if "ends" not in self._pp_end_groups:
            mine = None
            for column in self.mesh.mesh.reshape(self.pp_size, -1).T.tolist():
                ends = [column[0], column[-1]]
                group = dist.new_group(ends)
                if self.rank in ends:
                    mine = group
            self._pp_end_groups["ends"] = mine
        return self._pp_end_groups["ends"]

    def __str__(self) -> str:
        pp = f"pp {self.pp_rank}/{self.pp_size}, " if self.pp_size > 1 else ""
        cp = f"cp {self.cp_rank}/{self.cp_size}, " if self.cp_size > 1 else ""
        return (f"rank {self.rank}/{self.world_size} ({pp}dp {self.dp_rank}/{self.dp_size}, "
                f"ep {self.ep_rank}/{self.ep_size}, {cp}tp {self.tp_rank}/{self.tp_size}) "
                f"on {self.device}")

    def close(self, timeout: float = DEFAULT_TEARDOWN_TIMEOUT_S) -> None:
        """Destroy the process groups this context created (``init_parallel`` started the default
        group: it and every group made from it). Idempotent; a group the context found already
        initialised is left to whoever created it. Never hangs: a backend that does not finish
        within ``timeout`` seconds (a peer is gone) is abandoned with a warning. Also runs at
        interpreter exit, so a script may simply return."""
        atexit.unregister(self.close)
        if self.owned_group is not None:
            destroy_process_groups(self.owned_group, timeout)

    def __enter__(self) -> ParallelContext:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def check_degrees(world_size: int, tp: int, dp: int | None, ep: int, *,
                  pp: int = 1) -> tuple[int, int, int]:
    """Validate the parallel degrees against the world size; returns ``(dp, ep, tp)``."""
    dp, ep, _, tp = check_mesh_degrees(world_size, tp=tp, dp=dp, ep=ep, cp=1, pp=pp)
    return dp, ep, tp


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def init_parallel(tp: int = 1, dp: int | None = None, ep: int = 1, backend: str | None = None,
                  timeout: timedelta | float = DEFAULT_TIMEOUT, ranks_per_node: int | None = None,
                  profile=None, ranks_per_island: int | None = None,
                  cp: int = 1, pp: int = 1) -> ParallelContext:
    """Set up the ``pp × dp × ep × cp × tp`` rank grid and return this rank's
    :class:`ParallelContext`.

    Reuses an initialised default process group, or initialises one from the ``torchrun``
    environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).
    Without either, a single process gets :meth:`ParallelContext.single`. ``backend`` defaults to
    ``nccl`` when CUDA is available, else ``gloo``. ``dp=None`` means
    ``world_size // (pp·tp·ep·cp)``; ``cp``: the context-parallel degree (each sequence split over
    ``cp`` ranks, laid out between ``ep`` and ``tp``, so a ``cp`` group holds ranks ``tp`` apart);
    ``pp``: pipeline stages, the outermost axis (``ranks 0..world/pp-1`` are the first stage);
    ``ot.pipeline`` splits a model over them.
    ``timeout`` (a ``timedelta`` or seconds) bounds every collective, so a dead peer ends in an
    error instead of a hang.

    ``ranks_per_node``: ``None`` reads ``torchrun``'s ``LOCAL_WORLD_SIZE`` (all ranks on one node
    without it); a number declares it, e.g. ``4`` ranks as 2 nodes × 2 on one machine. ``profile``:
    the hardware profile (a :class:`~ops_transformer.planner.HardwareProfile`, or the path of one
    written by ``ops-transformer calibrate``; ``None``: the built-in one) from which the
    communication engine chooses each group's collective algorithms and ``parallelize`` its
    strategies. ``ranks_per_island``: the consecutive ranks of a node that share a PCIe island
    (GPUs behind one PCIe switch or socket), e.g. ``2`` for 4 ranks as 2 islands × 2 — groups that
    span islands may then run their collectives in stages (inside each island, then between them),
    when the profile says that is faster; ``None`` detects it from the topology on a GPU node
    (NVML / ``nvidia-smi topo -m``), one island per node otherwise. Rank 0's ``ranks_per_node``,
    ``ranks_per_island`` and ``profile`` are broadcast: all ranks decide alike.
    """
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    created = not (dist.is_available() and dist.is_initialized())
    if not created:
        world_size = dist.get_world_size()
        backend = dist.get_backend()
    else:
        world_size = _env_int("WORLD_SIZE")
        if world_size is None:
            need = pp * tp * (dp or 1) * ep * cp
            if need != 1:
                check_mesh_degrees(need, tp=tp, dp=dp, ep=ep, cp=cp, pp=pp)  # bad values: name them
                raise ValueError(
                    f"{f'pp ({pp}) × ' if pp > 1 else ''}tp ({tp}) × dp ({dp or 1}) × ep ({ep})"
                    f"{f' × cp ({cp})' if cp > 1 else ''} needs {need} "
                    f"processes, but this is a single process with no torchrun environment: start "
                    f"it with `torchrun --nproc-per-node N` or `ops_transformer.launch(fn, N)`")
            backend = backend or _default_backend()
            device = (torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend
                      else torch.device("cpu"))
            single = ParallelContext.single(device)
            return dataclasses.replace(single, ranks_per_node=1,
                                       profile=resolve_profile_source(profile, backend))
        rank = _env_int("RANK")
        if rank is None:
            raise ValueError("WORLD_SIZE is set but RANK is not: start the job with torchrun or "
                             "ops_transformer.launch")
        backend = backend or _default_backend()
        # fail before any rendezvous
        dp, ep, cp, tp = check_mesh_degrees(world_size, tp=tp, dp=dp, ep=ep, cp=cp, pp=pp)
        device_id = None
        if backend == "nccl":
            device_id = torch.device("cuda", _local_rank(rank))
            torch.cuda.set_device(device_id)
        store = job_store(os.environ, backend, world_size, timeout)  # torchrun's, namespaced
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device_id,
                                **({} if store is None else {"store": store}))
    dp, ep, cp, tp = check_mesh_degrees(world_size, tp=tp, dp=dp, ep=ep, cp=cp, pp=pp)
    rank = dist.get_rank()
    declared = ranks_per_node is not None
    if not declared:
        ranks_per_node = _env_int("LOCAL_WORLD_SIZE")
    try:
        layout, agreed = agree_setup(rank, world_size, ranks_per_node, profile, backend,
                                     declared=declared, ranks_per_island=ranks_per_island)
    except ValueError:
        if created:  # raised on every rank alike: leave no half-made job behind
            destroy_process_groups()
        raise
    if not created and "nccl" in backend and _env_int("LOCAL_RANK") is not None:
        torch.cuda.set_device(_local_rank(rank))  # a caller's group: one GPU a rank
    device = (torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend
              else torch.device("cpu"))
    from torch.distributed.device_mesh import init_device_mesh

    # pp (outermost) and cp (before tp) are axes only when above 1: at 1 the mesh keeps the
    # three axes it had before them
    axes = [(PP_AXIS, pp)] * (pp > 1) + [("dp", dp), ("ep", ep)] + [("cp", cp)] * (cp > 1) \
        + [("tp", tp)]
    mesh = init_device_mesh(device.type, tuple(n for _, n in axes),
                            mesh_dim_names=tuple(name for name, _ in axes))
    # from_mesh may create more (flattened) groups, build_engine the engine's sub-groups
    ctx = ParallelContext.from_mesh(mesh, device, backend, ranks_per_node=layout.ranks_per_node,
                                    profile=agreed, ranks_per_island=layout.ranks_per_island)
    build_engine(mesh, layout, agreed, rank, timeout,
                 dp_ep_group=ctx.dp_ep_group if dp > 1 and ep > 1 else None)
    # No rank returns before every rank has connected its groups through the rendezvous store,
    # which rank 0 may host: a rank 0 that finished and exited would break the others' set-up.
    C.barrier(dist.group.WORLD)
    return _own_default_group(ctx) if created else ctx


def _default_backend() -> str:
    """NCCL when a GPU is visible, else gloo. ``device_count`` asks NVML and leaves CUDA
    uninitialised (``is_available`` may not, which would make forking ranks unsafe)."""
    return "nccl" if torch.cuda.device_count() > 0 else "gloo"


def check_local_ranks(nproc: int, what: str = "nproc") -> None:
    """Raise a ``ValueError`` when ``nproc`` local ranks would run on NCCL (GPUs are visible)
    with fewer GPUs than ranks: each rank needs its own (``set_device(local_rank)``)."""
    gpus = torch.cuda.device_count()
    if 0 < gpus < nproc:
        raise ValueError(f"{what} {nproc}: NCCL needs one GPU per local rank, but {gpus} GPU(s) "
                         f"are visible; use {what} {gpus} or fewer (or hide the GPUs with "
                         f"CUDA_VISIBLE_DEVICES= to run {nproc} CPU ranks on gloo)")


def _local_rank(rank: int) -> int:
    """This rank's GPU: ``LOCAL_RANK``. Every rank of a node checks the same numbers
    (``LOCAL_WORLD_SIZE`` against the visible GPUs), so all raise alike before the rendezvous
    rather than some waiting in it for peers that failed."""
    gpus = torch.cuda.device_count()
    local = _env_int("LOCAL_RANK")
    per_node = _env_int("LOCAL_WORLD_SIZE") or (1 if local is None else local + 1)
    if per_node > gpus:
        raise ValueError(
            f"NCCL needs one GPU per local rank: {per_node} ranks on this node "
            f"(--nproc / --nproc-per-node), but {gpus} GPU(s) are visible; start at most {gpus} "
            f"ranks per node, or use backend='gloo' (CPU tensors)")
    return local if local is not None else rank % gpus


def _own_default_group(ctx: ParallelContext) -> ParallelContext:
    """``ctx`` as the owner of the default group ``init_parallel`` just started: ``close()``
    destroys it, and so does an ``atexit`` hook if the script never calls ``close()``."""
    ctx = dataclasses.replace(ctx, owned_group=dist.group.WORLD)
    atexit.register(ctx.close)
    return ctx

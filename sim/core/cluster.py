"""A cluster as a list of pools, and prefill/decode disaggregation between them (docs/simulator.md,
Pools and prefill/decode disaggregation).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import simpy
from omegaconf import DictConfig, OmegaConf

from policies.checks import check_policy
from policies.protocols import DecodePoolScheduler, PrefillPoolScheduler
from policies.types import Request
from policies.validators import boolean, non_negative_number, positive_int, positive_number
from sim.core.build import build_router, num_kv_blocks
from sim.core.settings import ReplicaSettings, RunSettings, replica_settings
from sim.cost.pipeline import KEY as PIPELINE_KEY
from runtime.handoff import Handoff, admit_handoffs, land, take_handoffs
from runtime.policy_config import CONF_DIR, build_policy, config_names, policy_config
from runtime.specs import HardwareSpec, ModelSpec

ROLES = ("mixed", "prefill", "decode")
POOL_KEYS = ("name", "role", "num_replicas", "router", "hardware", "tensor_parallel_size",
             "pipeline_parallel_size", "scheduler", "kv_cache")
TOPOLOGIES = ("per_replica", "shared")


@dataclass
class Pool:
    """One pool as the run builds it: its name and role, the run's config with the pool's
    overrides (`cfg`, for its policy groups) and their `settings`, its hardware, KV blocks per
    replica and router."""

    name: str
    role: str
    num_replicas: int
    cfg: DictConfig
    settings: ReplicaSettings
    hardware: HardwareSpec
    num_kv_blocks: int
    router: object


def build_pools(cfg: DictConfig, model: ModelSpec, run: RunSettings) -> list[Pool]:
    """The run's pools, checked: without `cluster.pools` one mixed pool; else one per entry, at most
    one of each role, a prefill pool only with a decode pool."""
    pools_cfg = cfg.cluster.get("pools")
    if pools_cfg is None:
        hardware = HardwareSpec.from_config(cfg.hardware)
        settings = replica_settings(cfg, model, run)
        return [Pool("main", "mixed", cfg.cluster.num_replicas, cfg, settings, hardware,
                     num_kv_blocks(settings, hardware), build_router(cfg.cluster.router))]
    if isinstance(pools_cfg, (str, bytes)) or not hasattr(pools_cfg, "__len__") or not pools_cfg:
        raise ValueError(f"cluster.pools must be a non-empty list of pools, got {pools_cfg!r}")
    # Resolved once into a plain config, so that each pool's overrides can merge into it.
    base = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    pools, names, roles = [], set(), set()
    for index, entry in enumerate(pools_cfg):
        field = f"cluster.pools[{index}]"
        if not isinstance(entry, (Mapping, DictConfig)):
            raise ValueError(f"{field} must be a mapping with name, role and num_replicas, got "
                             f"{entry!r}")
        unknown = sorted(set(entry.keys()) - set(POOL_KEYS))
        if unknown:
            raise ValueError(f"{field}: unknown key(s) {unknown}; a pool takes "
                             f"{', '.join(POOL_KEYS)}")
        name, role = entry.get("name"), entry.get("role")
        if not isinstance(name, str) or not name or name in names:
            raise ValueError(f"{field}.name must be a name no other pool has, got {name!r}")
        if role not in ROLES or role in roles:
            raise ValueError(f"{field}.role must be one of {', '.join(ROLES)}, one pool each; "
                             f"got {role!r}")
        names.add(name)
        roles.add(role)
        num_replicas = positive_int(f"{field}.num_replicas", entry.get("num_replicas"))
        pool_cfg = _pool_config(base, entry, field)
        settings = replica_settings(
            pool_cfg, model, run, f"{field}.pipeline_parallel_size"
            if entry.get("pipeline_parallel_size") is not None else PIPELINE_KEY)
        hardware = HardwareSpec.from_config(pool_cfg.hardware)
        router_cfg = entry.get("router") or cfg.cluster.router
        router = build_policy(policy_config(router_cfg, "router", f"{field}.router"),
                              f"{field}.router")
        pools.append(Pool(name, role, num_replicas, pool_cfg, settings, hardware,
                          num_kv_blocks(settings, hardware), router))
    if ("prefill" in roles) != ("decode" in roles):
        raise ValueError("cluster.pools: a prefill pool needs a decode pool and the other way "
                         f"round; the pools' roles: {', '.join(pool.role for pool in pools)}")
    return pools


def _pool_config(base: DictConfig, entry, field: str) -> DictConfig:
    """The run's config with the pool's overrides of hardware, tensor_parallel_size,
    pipeline_parallel_size, scheduler and kv_cache."""
    pool_cfg = base.copy()
    for size in ("tensor_parallel_size", "pipeline_parallel_size"):
        if entry.get(size) is not None:
            pool_cfg.cluster[size] = positive_int(f"{field}.{size}", entry[size])
    for group in ("hardware", "scheduler", "kv_cache"):
        override = entry.get(group)
        if override is None:
            continue
        if isinstance(override, str) and group == "hardware":
            hardware_file = CONF_DIR / "hardware" / f"{override}.yaml"
            if not hardware_file.is_file():
                raise ValueError(f"{field}.hardware must be one of "
                                 f"{', '.join(config_names('hardware'))} or a mapping, got "
                                 f"{override!r}")
            pool_cfg.hardware = OmegaConf.load(hardware_file)
        elif isinstance(override, str):
            pool_cfg[group] = policy_config(override, group, f"{field}.{group}")
        elif isinstance(override, (Mapping, DictConfig)):
            override = OmegaConf.create(OmegaConf.to_container(OmegaConf.create(override)))
            # A mapping that names its class replaces the group; one without adds fields to it.
            pool_cfg[group] = (override if "_target_" in override
                               else OmegaConf.merge(pool_cfg[group], override))
        else:
            raise ValueError(f"{field}.{group} must be a conf/{group} name or a mapping, got "
                             f"{override!r}")
    return pool_cfg


def is_disaggregated(pools: list[Pool]) -> bool:
    return any(pool.role == "prefill" for pool in pools)


# ---- the KV transfer ----------------------------------------------------------------------------

@dataclass
class KVTransferModel:
    """How long a request's KV takes to move: `latency_ms` plus its bytes over `bandwidth_gbps`;
    with `overlap` only what outlasts the prefill step is exposed (at least one layer's share)."""

    bandwidth_gbps: float
    latency_ms: float
    overlap: bool
    topology: str
    kv_bytes_per_token: int
    num_layers: int

    @classmethod
    def from_config(cls, transfer_cfg, model: ModelSpec) -> KVTransferModel:
        if transfer_cfg is None:
            raise ValueError("cluster.kv_transfer (bandwidth_gbps, latency_ms, overlap, "
                             "topology) is required with a prefill and a decode pool")
        bandwidth = transfer_cfg.get("bandwidth_gbps")
        if isinstance(bandwidth, (int, float)) and not isinstance(bandwidth, bool) \
                and bandwidth == 0:
            raise ValueError("cluster.kv_transfer.bandwidth_gbps is 0: no KV could move from "
                             "the prefill pool to the decode pool; give a positive GB/s (or "
                             "run colocated: cluster.disaggregate=never, or one mixed pool)")
        topology = transfer_cfg.get("topology", "per_replica")
        if topology not in TOPOLOGIES:
            raise ValueError(f"cluster.kv_transfer.topology must be one of "
                             f"{', '.join(TOPOLOGIES)}, got {topology!r}")
        return cls(positive_number("cluster.kv_transfer.bandwidth_gbps", bandwidth),
                   non_negative_number("cluster.kv_transfer.latency_ms",
                                       transfer_cfg.get("latency_ms", 0.0)),
                   boolean("cluster.kv_transfer.overlap", transfer_cfg.get("overlap", False)),
                   topology, model.kv_bytes_per_token, model.num_layers)

    def num_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.kv_bytes_per_token

    def duration(self, num_bytes: int, prefill_step_s: float) -> float:
        copy_s = num_bytes / (self.bandwidth_gbps * 1e9)
        if self.overlap:
            copy_s = max(copy_s - prefill_step_s, copy_s / self.num_layers)
        return self.latency_ms / 1000.0 + copy_s


class Links:
    """The links transfers share, one simpy resource each: a NIC per replica (per_replica: a
    transfer holds its prefill's, then its decode's), or one for all (shared)."""

    def __init__(self, env: simpy.Environment, topology: str, replica_ids: list[int]):
        self.topology = topology
        if topology == "shared":
            self._shared = simpy.Resource(env, capacity=1)
        else:
            self._by_replica = {replica_id: simpy.Resource(env, capacity=1)
                                for replica_id in replica_ids}

    def between(self, source_id: int, destination_id: int) -> list[simpy.Resource]:
        """The links a transfer holds, in the order it claims them (prefill side first, so
        that no two transfers wait on each other)."""
        if self.topology == "shared":
            return [self._shared]
        return [self._by_replica[source_id], self._by_replica[destination_id]]


class NextClusterEvent:
    """The horizon of a pool replica's repeated steps: the earliest a transfer could start or land,
    or a request arrive (a `NextArrival` look-alike)."""

    __slots__ = ("cluster",)

    def __init__(self, cluster: DisaggregatedCluster):
        self.cluster = cluster

    @property
    def time(self) -> float:
        return self.cluster.next_event()


class ClusterRouter:
    """The router of a disaggregated cluster: the disaggregation policy picks the pool, the pool's
    router the replica; n > 1 always runs colocated (a transfer moves one sequence)."""

    def __init__(self, replicas_by_role: dict[str, list], routers: dict[str, object], policy):
        self.replicas_by_role = replicas_by_role
        self.routers = routers
        self.policy = policy
        self.colocated_role = "mixed" if "mixed" in replicas_by_role else "prefill"
        self.replica_ids = {role: {replica.replica_id for replica in replicas}
                            for role, replicas in replicas_by_role.items()}

    def route(self, request: Request, replicas) -> int:
        role = self.colocated_role
        if request.n == 1 and self.policy.disaggregate(request, self.replicas_by_role):
            request.handoff = True
            role = "prefill"
        return route_within(self.routers[role], request, self.replicas_by_role[role],
                            self.replica_ids[role], role)


def route_within(router, request: Request, replicas: list, replica_ids: set[int],
                 role: str) -> int:
    replica_id = router.route(request, replicas)
    if replica_id not in replica_ids:
        raise ValueError(f"{type(router).__name__}.route returned replica {replica_id!r}, not a "
                         f"replica of the {role} pool ({sorted(replica_ids)})")
    return replica_id


class DisaggregatedCluster:
    """The hand-offs from prefill replicas, the decode replicas' admission of them and the
    transfers over the links."""

    def __init__(self, env: simpy.Environment, replicas: list, pools: list[Pool],
                 transfer: KVTransferModel, disaggregation, next_arrival):
        self.env = env
        self.next_arrival = next_arrival
        self.transfer = transfer
        self.replicas_by_role: dict[str, list] = {}
        for replica in replicas:
            self.replicas_by_role.setdefault(replica.role, []).append(replica)
        self.prefill_replicas = self.replicas_by_role["prefill"]
        self.decode_replicas = self.replicas_by_role["decode"]
        for role, protocol in (("prefill", PrefillPoolScheduler),
                               ("decode", DecodePoolScheduler)):
            for replica in self.replicas_by_role[role]:
                check_policy(replica.scheduler, protocol, f"scheduler of a {role} pool")
        self.decode_ids = {replica.replica_id for replica in self.decode_replicas}
        self.by_id = {replica.replica_id: replica for replica in replicas}
        routers = {pool.role: pool.router for pool in pools}
        self.decode_router = routers["decode"]
        self.router = ClusterRouter(self.replicas_by_role, routers, disaggregation)
        self.links = Links(env, transfer.topology, list(self.by_id))
        # Per decode replica, the hand-offs waiting for room there, first come first served.
        self.waiting: dict[int, deque[Handoff]] = {
            replica.replica_id: deque() for replica in self.decode_replicas}
        self._landing_times: dict[int, float] = {}   # request_id -> end of its copy in flight
        horizon = NextClusterEvent(self)
        for replica in self.prefill_replicas:
            replica.on_step_done = self._hand_off
            replica.next_arrival = horizon
        for replica in self.decode_replicas:
            replica.on_step_done = self._admit_waiting
            replica.next_arrival = horizon

    def next_event(self) -> float:
        """The earliest that anything could reach a decode replica or free a prefill replica's
        blocks: an arrival, a prefill step's end, a transfer landing or, while hand-offs wait for
        room, a decode step's end."""
        earliest = min(self.next_arrival.time,
                       min([replica.busy_until for replica in self.prefill_replicas]))
        if self._landing_times:
            earliest = min(earliest, min(self._landing_times.values()))
        if any(self.waiting.values()):
            earliest = min(earliest, min([replica.busy_until for replica in self.decode_replicas]))
        return earliest

    def _hand_off(self, prefill) -> None:
        for handoff in take_handoffs(prefill.scheduler, prefill, prefill.last_step_duration):
            request = handoff.request
            request.prefill_replica_id = prefill.replica_id
            request.kv_handoff_time = self.env.now
            prefill.num_pending_transfers += 1
            decode_id = route_within(self.decode_router, request, self.decode_replicas,
                                     self.decode_ids, "decode")
            self.waiting[decode_id].append(handoff)
            decode = self.by_id[decode_id]
            if decode.busy_until == math.inf:   # idle; a busy one admits after its step
                self._admit_waiting(decode)

    def _admit_waiting(self, decode) -> None:
        """Start the transfers of the hand-offs waiting for `decode` while it has room: between
        its steps, as its scheduler admits arrivals (repeated steps take blocks when they end)."""
        def start_copy(handoff: Handoff) -> None:
            decode.num_pending_transfers += 1
            num_bytes = self.transfer.num_bytes(handoff.source_seq.num_computed_tokens)
            duration = self.transfer.duration(num_bytes, handoff.prefill_step_s)
            # The earliest it can land, until it has its links: what bounds repeated steps.
            self._landing_times[handoff.request.request_id] = self.env.now + duration
            self.env.process(self._copy(handoff, decode, num_bytes, duration))

        def rejected(handoff: Handoff) -> None:   # it can never run there
            self._source_released(handoff)
            decode.ended([handoff.request])

        admit_handoffs(self.waiting[decode.replica_id], decode.scheduler, self.env.now,
                       start_copy, rejected)

    def _copy(self, handoff: Handoff, decode, num_bytes: int, duration: float):
        request = handoff.request
        claims = []
        for link in self.links.between(handoff.source.replica_id, decode.replica_id):
            claim = link.request()
            yield claim
            claims.append((link, claim))
        request.kv_transfer_start_time = self.env.now
        request.kv_transfer_bytes = num_bytes
        self._landing_times[request.request_id] = self.env.now + duration
        yield self.env.timeout(duration)
        del self._landing_times[request.request_id]
        for link, claim in claims:
            link.release(claim)
        request.kv_transfer_end_time = self.env.now
        land(handoff, decode.scheduler, decode.replica_id, self.env.now)
        self._source_released(handoff)
        decode.num_pending_transfers -= 1
        decode.wake()

    @staticmethod
    def _source_released(handoff: Handoff) -> None:
        """The prefill replica's blocks went back: it may plan again."""
        prefill = handoff.source
        prefill.num_pending_transfers -= 1
        prefill.wake()


# ---- what the summary adds ----------------------------------------------------------------------

def pools_summary(pools: list[Pool], replicas: list, steps: np.ndarray, step_columns,
                  duration_s: float) -> dict:
    """`per_pool`: each pool's role, replicas, KV blocks per replica, steps, prefill tokens and
    decodes, busy seconds and utilisation (busy time over its replicas' share of the run)."""
    columns = {name: index for index, name in enumerate(step_columns)}
    per_pool = {}
    for pool in pools:
        ids = [replica.replica_id for replica in replicas if replica.pool == pool.name]
        rows = steps[np.isin(steps[:, columns["replica_id"]], ids)] if len(steps) else steps
        busy_s = math.fsum(rows[:, columns["duration"]]) if len(rows) else 0.0
        per_pool[pool.name] = {
            "role": pool.role, "num_replicas": pool.num_replicas,
            "num_kv_blocks": pool.num_kv_blocks, "num_steps": int(len(rows)),
            "num_prefill_tokens": int(rows[:, columns["num_prefill_tokens"]].sum()),
            "num_decode_seqs": int(rows[:, columns["num_decode_seqs"]].sum()),
            "busy_s": busy_s,
            "utilization": (busy_s / (duration_s * pool.num_replicas)) if duration_s > 0 else 0.0,
        }
    return {"per_pool": per_pool}


def kv_transfer_summary(requests: list[Request]) -> dict:
    """The transfers of the run: how many, their bytes, and the mean and p99 of a request's time
    from hand-off to landing (waiting for room and links included) and of the copy alone."""
    moved = [request for request in requests if request.kv_transfer_end_time is not None]
    waits_ms = np.array([(r.kv_transfer_end_time - r.kv_handoff_time) * 1000.0 for r in moved])
    copies_ms = np.array([(r.kv_transfer_end_time - r.kv_transfer_start_time) * 1000.0
                          for r in moved])

    def stat(values: np.ndarray, percentile: float | None) -> float:
        if not values.size:
            return 0.0
        return float(values.mean() if percentile is None else np.percentile(values, percentile))

    return {"num_kv_transfers": len(moved),
            "kv_transfer_bytes": int(sum(request.kv_transfer_bytes for request in moved)),
            "mean_kv_transfer_ms": stat(waits_ms, None),
            "p99_kv_transfer_ms": stat(waits_ms, 99.0),
            "mean_kv_copy_ms": stat(copies_ms, None),
            "p99_kv_copy_ms": stat(copies_ms, 99.0)}

"""One driver steps every simulated replica (sim/core/replica.py): a replica alone, the ranks of
a lockstep group and the virtual engines of a pipelined replica all run through `ReplicaDriver`,
given a step timing, and its idle wait and finish reports behave alike for all three."""
from __future__ import annotations

import pytest
import simpy

from factories import make_cfg
from policies.types import Request
from sim.core.experiment import run_experiment
from sim.core.lockstep import Lockstep
from sim.core.pipelined_replica import ThroughStages
from sim.core.replica import OwnTime, Replica, ReplicaDriver, SimEnvironment

KINDS = {
    "alone": (["cluster.num_replicas=2"], OwnTime),
    "lockstep group": (["model=tiny-moe", "cluster.num_replicas=2",
                        "cluster.expert_parallel_size=2"], Lockstep),
    "pipeline stages": (["cost_model=roofline", "cluster.pipeline_parallel_size=2"],
                        ThroughStages),
}


def drivers_of(replicas: list[Replica]) -> list[ReplicaDriver]:
    """The run's distinct drivers, in the order of the lanes they step."""
    drivers = []
    for replica in replicas:
        for lane in replica.lanes:
            if all(lane.driver is not driver for driver in drivers):
                drivers.append(lane.driver)
    return drivers


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_replica_runs_through_the_one_driver(kind, monkeypatch):
    """Requests 4 s apart, each done long before the next: each replica (or group) is idle
    when one arrives, and the submit wakes its driver, which plans it at its arrival; each
    request is reported ended once. A lockstep group is one driver over its ranks' lanes, a
    pipelined replica one per engine, a replica alone one over its lane."""
    overrides, timing = KINDS[kind]
    ended = []
    report = Replica.ended
    monkeypatch.setattr(Replica, "ended",
                        lambda self, requests: (ended.extend(requests), report(self, requests)))
    requests = [Request(request_id=i, arrival_time=4.0 * i, prompt_len=32, output_len=3)
                for i in range(4)]
    result = run_experiment(make_cfg(*overrides, "cluster.frontend_latency_s=0",
                                     "workload.num_requests=4"),
                            plots=False, requests=requests)
    for request in result.requests:
        assert request.first_scheduled_time == request.arrival_time
        assert request.finish_time < request.arrival_time + 4.0
    assert sorted(request.request_id for request in ended) == [0, 1, 2, 3]

    assert all(type(replica) is Replica for replica in result.replicas)
    drivers = drivers_of(result.replicas)
    assert all(type(driver) is ReplicaDriver and type(driver.timing) is timing
               for driver in drivers)
    lanes = [lane for replica in result.replicas for lane in replica.lanes]
    expected_drivers = {"alone": 2, "lockstep group": 1, "pipeline stages": 2}[kind]
    assert len(drivers) == expected_drivers
    assert sum(len(driver.lanes) for driver in drivers) == len(lanes)


def test_skip_to_moves_the_clock_only_where_no_event_is_due_by_then():
    env = SimEnvironment()
    woken = []
    env.timeout(5.0).callbacks.append(lambda _: woken.append(env.now))
    assert env.skip_to(4.0) and env.now == 4.0
    assert not env.skip_to(5.0)   # a tie: the event scheduled first goes first
    assert not env.skip_to(6.0) and env.now == 4.0
    env.run()
    assert woken == [5.0] and env.skip_to(7.0) and env.now == 7.0


def test_a_replica_on_a_bare_simpy_environment_is_refused_in_one_line():
    with pytest.raises(TypeError, match="env must be sim.core.replica.SimEnvironment"):
        Replica(simpy.Environment(), 0, [], executor=None, metrics=None)

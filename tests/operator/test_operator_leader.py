"""The Lease elector against a real API server: one leader, fencing before take-over, fast hand-over on release."""

from __future__ import annotations

import asyncio

from daybreak.devenv.cluster import LocalCluster
from daybreak.operator.kube import LEASE, KubeClient, load_configuration
from daybreak.operator.leader import Identity, LeaseElector, LeaseTiming


def test_one_leader_takeover_after_silence_and_release(kube: LocalCluster) -> None:
    async def scenario() -> None:
        configuration, _ = await load_configuration(str(kube.kubeconfig))
        client = KubeClient(configuration)
        timing = LeaseTiming(lease_duration=3.0, renew_deadline=2.0, retry_period=0.5)
        name = "op-leader-test"

        def elector(identity: str) -> LeaseElector:
            return LeaseElector(client, namespace="default", name=name, identity=Identity(identity), timing=timing)

        a, b = elector("a"), elector("b")
        try:
            await asyncio.wait_for(a.acquire(), timeout=30)
            assert a.is_leader()
            hold_a = asyncio.create_task(a.hold())
            campaign_b = asyncio.create_task(b.acquire())
            # Twice the lease duration: a keeps renewing, so b must still be waiting.
            await asyncio.sleep(2 * timing.lease_duration)
            assert not campaign_b.done()
            assert not hold_a.done() and a.is_leader()

            # a goes silent as if its process froze: no renewals, no release.
            hold_a.cancel()
            await asyncio.wait_for(campaign_b, timeout=30)
            # The fence: by the time b holds the Lease, a no longer believes it leads.
            assert b.is_leader()
            assert not a.is_leader()
            lease = await client.get(LEASE, name, namespace="default")
            assert lease["spec"]["holderIdentity"] == "b"
            assert lease["spec"]["leaseTransitions"] == 1

            # A graceful release lets the next candidate in without waiting for expiry.
            await b.release()
            assert not b.is_leader()
            released = await client.get(LEASE, name, namespace="default")
            assert not released["spec"].get("holderIdentity")
            await asyncio.wait_for(a.acquire(), timeout=timing.retry_period * 4 + 10)
            assert (await client.get(LEASE, name, namespace="default"))["spec"]["holderIdentity"] == "a"
        finally:
            await client.delete(LEASE, name, namespace="default")
            await client.close()

    asyncio.run(scenario())

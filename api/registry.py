"""The one list of resource kinds Daybreak serves: ``daybreak crds``, the docs and the tests all read it.

To add a kind, define a ``CustomResource`` subclass and append it here.
"""

from __future__ import annotations

from daybreak.api.base import CustomResource
from daybreak.api.kvpool import KVPool
from daybreak.api.node import KVNode
from daybreak.api.pddeployment import PDDeployment

CRD_KINDS: list[type[CustomResource]] = [
    KVPool,
    PDDeployment,
    KVNode,
]

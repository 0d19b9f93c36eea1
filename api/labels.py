"""The Kubernetes vocabulary every Daybreak process matches on: label keys, annotation keys, CRD coordinates.

A label written by the operator and selected on by the router, the status
command or the dev dashboards is one contract; spelling it in each of them
lets one side drift silently (client-go keeps the same list in
``well_known_labels.go``). Every key is declared here once and imported where
it is used; ``tests/test_vocabulary.py`` fails when one of these strings is
spelled out again in non-test code. Constants only: no imports, no I/O, so
any layer may read it.
"""

from __future__ import annotations

# --- CRD coordinates (the models' ``CRDInfo`` and every REST path use these) -------------------------------
GROUP = "daybreak.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KVPOOL_KIND, KVPOOL_PLURAL = "KVPool", "kvpools"
PDDEPLOYMENT_KIND, PDDEPLOYMENT_PLURAL = "PDDeployment", "pddeployments"
KVNODE_KIND, KVNODE_PLURAL = "KVNode", "kvnodes"

# --- Recommended labels (https://kubernetes.io/docs/concepts/overview/working-with-objects/common-labels/) --
NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = "app.kubernetes.io/managed-by"
PART_OF = "app.kubernetes.io/part-of"

# --- Which parent and role a child belongs to (written by the operator, selected on by router, status, dev) -
POOL = "daybreak.dev/pool"
DEPLOYMENT = "daybreak.dev/deployment"
ROLE = "daybreak.dev/role"
KV_NAMESPACE = "daybreak.dev/kv-namespace"
"""On engine pods (label) and credential Secrets / PDDeployments (annotation): the pod's kvNamespace."""

# --- Annotations the operator writes on its children --------------------------------------------------------
APPLIED_HASH = "daybreak.dev/applied-hash"
"""The hash of the last applied manifest: an unchanged watched child is not applied again."""
CONFIG_HASH = "daybreak.dev/config-hash"
"""On the agent DaemonSet's pod template: a changed agent config rolls the agents."""
REVISION = "daybreak.dev/revision"
"""On role Deployments: the PDDeployment revision a pod template belongs to."""

# --- Node labels the agent publishes (NFD/GFD style), read by node selectors and the dev cluster -----------
ACCELERATOR = "daybreak.dev/accelerator"
ACCELERATOR_COUNT = "daybreak.dev/accelerator-count"
ACCELERATOR_MEMORY = "daybreak.dev/accelerator-memory"
RDMA = "daybreak.dev/rdma"
GDR = "daybreak.dev/gdr"
LINK_DOMAIN = "daybreak.dev/link-domain"
NODE_LABELS = (ACCELERATOR, ACCELERATOR_COUNT, ACCELERATOR_MEMORY, RDMA, GDR, LINK_DOMAIN)

VOCABULARY: frozenset[str] = frozenset({
    GROUP, API_VERSION, KVPOOL_PLURAL, PDDEPLOYMENT_PLURAL, KVNODE_PLURAL,
    NAME, INSTANCE, COMPONENT, MANAGED_BY, PART_OF, POOL, DEPLOYMENT, ROLE, KV_NAMESPACE,
    APPLIED_HASH, CONFIG_HASH, REVISION, *NODE_LABELS,
})
"""Every string above that must not be spelled out elsewhere (kinds are ordinary words and are left out)."""

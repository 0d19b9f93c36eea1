"""The PDDeployment resource: one model served by prefill and decode engines that share a KVPool."""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Literal

from pydantic import AwareDatetime, Field

from daybreak.api.base import (
    DNS_LABEL_NAME_RULE,
    ApiModel,
    CelRule,
    CRDInfo,
    CustomResource,
    PrinterColumn,
    nested,
)
from daybreak.api.kube import (
    Condition,
    EnvVar,
    FreeForm,
    LocalObjectReference,
    PercentOrCount,
    ResourceRequirements,
    conditions_field,
    env_field,
)
from daybreak.api.kvcompat import EngineKind, KVLayout, kv_namespace
from daybreak.api.labels import PDDEPLOYMENT_KIND, PDDEPLOYMENT_PLURAL


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"


class PlannerPolicy(StrEnum):
    """How the planner turns its model's estimate into replicas (``daybreak.operator.planner.POLICIES``)."""

    REACTIVE = "reactive"
    PREDICTIVE = "predictive"


class RoomOrder(StrEnum):
    """Which request waiting in the router for prefill room goes first (``router.roomOrder``)."""

    ARRIVAL = "arrival"
    DEADLINE = "deadline"


class CachePolicy(StrEnum):
    PRESERVE = "preserve"
    FLUSH = "flush"


class ModelSpec(ApiModel):
    """The model served, and the KV layout its engine produces."""

    name: str = Field(min_length=1, max_length=512)
    """Model name as the engine loads it (e.g. a Hugging Face id: meta-llama/Llama-3.1-8B-Instruct)."""
    revision: str = Field(min_length=1, max_length=256)
    """Exact weights revision (pin a commit hash; a moving tag like main can mix incompatible caches)."""
    kv_layout: KVLayout
    """KV cache shape; with name, revision and engine kind it determines status.kvNamespace."""


class EngineSpec(ApiModel):
    """The inference engine container run by prefill and decode pods."""

    __cel_rules__ = (
        CelRule(
            rule="self.kind == 'sim' || has(self.image)",
            message="image is required unless kind is sim",
            check=lambda e: e.kind == EngineKind.SIM or e.image is not None,
            field_path=".image",
            reason="FieldValueRequired",
        ),
        # sglang stays in EngineKind (it names a KV namespace family) but nothing wires it to the pool
        # yet: refused here, naming the field, rather than rendered as a server that caches nothing.
        CelRule(
            rule="self.kind != 'sglang'",
            message="kind sglang is not supported yet (no pool connector); use vllm or sim",
            check=lambda e: e.kind != EngineKind.SGLANG,
            field_path=".kind",
            reason="FieldValueForbidden",
        ),
    )

    kind: EngineKind
    """Engine: vllm or sim (Daybreak's simulated engine, for tests and demos); sglang is refused until supported."""
    image: str | None = Field(default=None, min_length=1)
    """Engine container image; the sim engine defaults to the operator's own image."""
    args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for the engine. The autoscaler reads --max-num-seqs N from them (decode's
    batch cap); without it the cap is learned from queues."""
    env: list[EnvVar] = env_field()
    """Extra environment variables for the engine container."""


class RoleSpec(ApiModel):
    """One role's scale set (prefill or decode). minReplicas <= replicas <= maxReplicas."""

    __cel_rules__ = (
        CelRule(
            rule="!has(self.minReplicas) || self.minReplicas <= self.replicas",
            message="minReplicas must be less than or equal to replicas",
            check=lambda r: r.min_replicas is None or r.min_replicas <= r.replicas,
            field_path=".minReplicas",
        ),
        CelRule(
            rule="!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
            message="replicas must be less than or equal to maxReplicas",
            check=lambda r: r.max_replicas is None or r.replicas <= r.max_replicas,
            field_path=".replicas",
        ),
    )

    replicas: int = Field(default=1, ge=0, le=10000)
    """Pods of this role (the autoscaler changes it within minReplicas..maxReplicas)."""
    min_replicas: int | None = Field(default=None, ge=0, le=10000)
    """Lower bound for the autoscaler; defaults to replicas. 0 on both roles: scale to zero with no traffic, back
    on the first request the router holds."""
    max_replicas: int | None = Field(default=None, ge=1, le=10000)
    """Upper bound for the autoscaler; defaults to replicas."""
    resources: ResourceRequirements | None = None
    """Compute resources of the engine container (accelerators included)."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Labels a node must carry to run pods of this role."""
    template: FreeForm | None = None
    """Partial Pod template (metadata and spec fields) merged over the generated one."""

    @property
    def bounds(self) -> tuple[int, int]:
        """(min, max) replicas for the autoscaler, each defaulting to replicas."""
        low = self.replicas if self.min_replicas is None else self.min_replicas
        high = self.replicas if self.max_replicas is None else self.max_replicas
        return low, high


class RouterAuthSpec(ApiModel):
    """Bearer-token authentication on the router's OpenAI endpoints."""

    secret_name: str = Field(min_length=1, max_length=253,
                             pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    """A Secret in the PDDeployment's namespace; each key is one credential: the key names the client (its
    identity for the per-client limits and its cache salt, so clients of different keys never share cached
    blocks) and the value is its bearer token (at least 16 characters). Mounted into the router pod, so a
    key added, changed or removed takes effect without a restart (within about a minute)."""


class RouterSpec(ApiModel):
    """The request router that sends each request to a prefill, then a decode pod."""

    __cel_rules__ = (
        CelRule(
            rule="self.decodePrefill == 0 || self.prefillConcurrency > 0",
            message="decodePrefill needs prefillConcurrency: only then does the router know prefill has no room",
            check=lambda r: r.decode_prefill == 0 or r.prefill_concurrency > 0,
            field_path=".decodePrefill",
        ),
        CelRule(
            rule="self.roomOrder == 'arrival' || self.prefillConcurrency > 0",
            message="roomOrder deadline needs prefillConcurrency: only then do requests wait in the router",
            check=lambda r: r.room_order is RoomOrder.ARRIVAL or r.prefill_concurrency > 0,
            field_path=".roomOrder",
        ),
    )

    enabled: bool = True
    """Run the router (Deployment and Service)."""
    replicas: int = Field(default=1, ge=0, le=100)
    """Router pods."""
    auth: RouterAuthSpec | None = None
    """Require a bearer token on /v1/*; unset: open to every client that reaches the Service (clients are
    then told apart by address)."""
    cache_statistics: bool = False
    """Report usage.prompt_tokens_details.cached_tokens and the usage.daybreak counters in replies. Off by
    default: with a cache shared across clients they tell a client whether anyone sent the same prompt
    before (per-credential cache salts under auth close that; see docs/security.md)."""
    prefill_concurrency: int = Field(default=0, ge=0, le=4096)
    """Prefill steps each router pod keeps in flight on one prefill pod; more wait in the router (first come,
    first served) for the first pod with room, a pod the planner just started included, and the planner
    counts them as prefill's backlog. 0: no bound (a request waits in the queue of the pod it was sent to on
    arrival). About the TTFT target over one prompt's prefill time is a start."""
    decode_prefill: int = Field(default=0, ge=0, le=256)
    """Prompts each decode pod may compute itself, at once, for requests that find no prefill pod with room
    (needs prefillConcurrency): they go straight to decode instead of waiting, and decode prefills them in its
    own batch, slowing the steps of the sequences it decodes meanwhile (Dynamo's conditional
    disaggregation). The planner counts them as prefill's backlog. 0: a request always waits for prefill."""
    room_order: RoomOrder = RoomOrder.ARRIVAL
    """Who takes a prefill room first (needs prefillConcurrency): arrival, first come first served; deadline,
    the requests that can still have their first token within autoscaling.ttftSeconds of arriving, then those
    that cannot (they miss it wherever they wait; they now wait longer, never past the router's hold limit).
    In a burst deadline keeps more requests within the target, at the cost of the late ones' TTFT."""


class AutoscalingSpec(ApiModel):
    """Latency-driven scaling of prefill (time to first token) and decode (inter-token latency)."""

    enabled: bool = False
    """Let the operator change role replicas within their bounds."""
    ttft_seconds: float = Field(default=1.0, gt=0, le=3600)
    """Target time to first token; prefill scales up when it is exceeded."""
    itl_seconds: float = Field(default=0.05, gt=0, le=60)
    """Target inter-token latency; decode scales up when it is exceeded."""
    interval_seconds: int = Field(default=15, ge=1, le=3600)
    """How often the metrics are evaluated."""
    scale_up_stabilization_seconds: int = Field(default=30, ge=0, le=3600)
    """A scale-up needs the target missed for this long."""
    scale_down_stabilization_seconds: int = Field(default=300, ge=0, le=86400)
    """A scale-down needs the load low for this long."""
    max_scale_up_step: int = Field(default=4, ge=1, le=1000)
    """Most replicas one decision adds to a role (fast scale-up)."""
    max_scale_down_step: int = Field(default=1, ge=1, le=1000)
    """Most replicas one decision removes from a role (slow scale-down)."""
    tolerance: float = Field(default=0.1, ge=0, le=1)
    """Relative dead band around the current replicas in which the estimate changes nothing (no flapping)."""
    policy: PlannerPolicy = PlannerPolicy.REACTIVE
    """reactive sizes for the demand seen now; predictive for the demand forecast one start-up time ahead
    (Holt's trend on the demand; the start-up time is learned from the pods the planner started) and keeps
    pods the forecast wants within the next start-up time plus the scale-down window."""


class UpdateStrategy(ApiModel):
    """How a spec change rolls out to the role pods."""

    __cel_rules__ = (
        CelRule(
            rule="!((self.maxSurge == 0 || self.maxSurge == '0%') && (self.maxUnavailable == 0"
            " || self.maxUnavailable == '0%'))",
            message="maxSurge and maxUnavailable must not both be 0",
            check=lambda u: not (u.max_surge in (0, "0%") and u.max_unavailable in (0, "0%")),
            field_path=".maxUnavailable",
        ),
    )

    max_surge: PercentOrCount = Field(default=1, json_schema_extra={"default": 1})
    """Extra pods per role allowed during a rollout (count or percentage)."""
    max_unavailable: PercentOrCount = Field(default=0, json_schema_extra={"default": 0})
    """Pods per role that may be unavailable during a rollout (count or percentage)."""
    cache: CachePolicy = CachePolicy.PRESERVE
    """On a change of status.kvNamespace: preserve keeps the old namespace's blocks until evicted,
    flush deletes them once the rollout completes."""


def _to_zero(role: RoleSpec) -> bool:
    return role.min_replicas == 0


class PDDeploymentSpec(ApiModel):
    """Desired state of a prefill/decode deployment."""

    __cel_rules__ = (
        # Scale to zero is for both roles together (a decode pool at zero behind a live prefill, or the other
        # way, serves nothing), and only behind the router, which holds requests while the first pods start.
        CelRule(
            rule="(has(self.prefill.minReplicas) && self.prefill.minReplicas == 0) =="
                 " (has(self.decode.minReplicas) && self.decode.minReplicas == 0)",
            message="minReplicas 0 (scale to zero) must be set on both prefill and decode",
            check=lambda s: _to_zero(s.prefill) == _to_zero(s.decode),
            field_path=".decode.minReplicas",
        ),
        CelRule(
            rule="!(has(self.prefill.minReplicas) && self.prefill.minReplicas == 0) || self.router.enabled",
            message="minReplicas 0 (scale to zero) needs router.enabled: the router holds requests while pods start",
            check=lambda s: not _to_zero(s.prefill) or s.router.enabled,
            field_path=".router.enabled",
        ),
    )

    pool_ref: LocalObjectReference
    """KVPool (same namespace) holding this deployment's KV cache."""
    model: ModelSpec
    """Model served."""
    engine: EngineSpec
    """Inference engine."""
    prefill: RoleSpec = nested(RoleSpec)
    """Prefill role."""
    decode: RoleSpec = nested(RoleSpec)
    """Decode role."""
    router: RouterSpec = nested(RouterSpec)
    """Request router."""
    autoscaling: AutoscalingSpec = nested(AutoscalingSpec)
    """Latency-driven autoscaling."""
    update_strategy: UpdateStrategy = nested(UpdateStrategy)
    """Rollout settings."""

    def kv_namespace(self) -> str:
        """The KV compatibility key of this spec (see ``daybreak.api.kvcompat``)."""
        return kv_namespace(
            model_name=self.model.name, model_revision=self.model.revision,
            layout=self.model.kv_layout, engine=self.engine.kind,
        )


class RoleStatus(ApiModel):
    """Observed pods of one role."""

    replicas: int = 0
    """Pods that exist."""
    ready_replicas: int = 0
    """Pods that are ready."""
    updated_replicas: int = 0
    """Pods running the current revision."""
    desired_replicas: int | None = Field(default=None, ge=0)
    """Replicas the autoscaler decided (within minReplicas..maxReplicas); the operator renders these instead of
    spec replicas while autoscaling is enabled."""


class LastScale(ApiModel):
    """The most recent replica change made by the autoscaler."""

    time: AwareDatetime
    """When it happened."""
    role: Role
    """Which role was scaled."""
    from_replicas: int = Field(ge=0)
    """Replicas before."""
    to_replicas: int = Field(ge=0)
    """Replicas after."""
    reason: str
    """Why (which target was missed or how long the load was low)."""
    numbers: dict[str, float] = Field(default_factory=dict)
    """The planner's inputs and estimate behind the decision (arrival rate, uncached tokens, latencies, ...)."""


class KVNamespaceRetirement(ApiModel):
    """An old kvNamespace being (or last) retired after a rollout changed status.kvNamespace."""

    kv_namespace: str
    """The namespace no engine of this deployment uses any more."""
    policy: CachePolicy
    """updateStrategy.cache when the change was seen."""
    since: AwareDatetime | None = None
    """When the new namespace started rolling out."""
    retired_at: AwareDatetime | None = None
    """When the last engine of the old namespace was rolled away."""
    bytes_freed: int | None = Field(default=None, ge=0)
    """Bytes of the old namespace deleted from the pool (flush only; unset when not flushed)."""
    message: str = ""
    """What happened to the old blocks."""


class PDDeploymentStatus(ApiModel):
    """Observed state of the deployment, written by the operator."""

    observed_generation: int | None = None
    """The metadata.generation this status describes."""
    conditions: list[Condition] = conditions_field()
    """Ready, Progressing and Degraded, with reasons (e.g. PoolNotFound)."""
    prefill: RoleStatus = Field(default_factory=RoleStatus)
    """Prefill pods."""
    decode: RoleStatus = Field(default_factory=RoleStatus)
    """Decode pods."""
    router: RoleStatus = Field(default_factory=RoleStatus)
    """Router pods."""
    kv_namespace: str | None = None
    """KV compatibility key of the current spec: engines only reuse blocks within one namespace."""
    revision: str | None = None
    """Hash of the pod template currently rolled out."""
    last_scale: LastScale | None = None
    """The most recent autoscaling decision."""
    retiring_kv_namespace: KVNamespaceRetirement | None = None
    """The previous kvNamespace while a rollout replaces it (decode waits for prefill to roll first)."""
    retired_kv_namespace: KVNamespaceRetirement | None = None
    """The most recently retired kvNamespace and what was done with its blocks."""


class PDDeployment(CustomResource):
    """A model served by disaggregated prefill and decode engines sharing a KVPool."""

    crd: ClassVar[CRDInfo] = CRDInfo(
        kind=PDDEPLOYMENT_KIND,
        plural=PDDEPLOYMENT_PLURAL,
        short_names=("pdd",),
        printer_columns=(
            PrinterColumn("Prefill", ".status.prefill.readyReplicas", "integer", "Ready prefill pods"),
            PrinterColumn("Decode", ".status.decode.readyReplicas", "integer", "Ready decode pods"),
            PrinterColumn("Ready", '.status.conditions[?(@.type=="Ready")].status', "string", "Ready condition"),
            PrinterColumn("KV-NS", ".status.kvNamespace", "string", "KV compatibility key"),
            PrinterColumn("Pool", ".spec.poolRef.name", "string", "KVPool used", priority=1),
            PrinterColumn("Engine", ".spec.engine.kind", "string", "Inference engine", priority=1),
            PrinterColumn("Model", ".spec.model.name", "string", "Model served", priority=1),
            PrinterColumn("Age", ".metadata.creationTimestamp", "date"),
        ),
    )

    __cel_rules__ = (DNS_LABEL_NAME_RULE,)

    kind: Literal["PDDeployment"] = "PDDeployment"
    """Kind of this object."""
    spec: PDDeploymentSpec
    """Desired state."""
    status: PDDeploymentStatus = Field(default_factory=PDDeploymentStatus)
    """Observed state (written by the operator)."""

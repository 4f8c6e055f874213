"""Named errors for everything a user, a peer or a file can get wrong.

Each carries a stable `code` (the reference designs' error codes) so the API,
the CLI and the wire protocol can report it without string matching.
"""


class MeshError(Exception):
    """Base for errors meant for a user: the message says what and how to fix it."""

    code = "internal"


class ModelLoadError(MeshError):
    """A model folder or file is missing, unreadable or inconsistent."""

    code = "model_load_failed"


class UnsupportedArchitecture(ModelLoadError):
    code = "unsupported_architecture"


class CorruptWeights(ModelLoadError):
    code = "corrupt_weights"


class ContextOverflow(MeshError):
    """A prompt (plus requested tokens) does not fit the model's context."""

    code = "context_length_exceeded"


class ShardUnavailable(MeshError):
    """No placement of the model fits the live fleet.

    `missing_bytes` (when known) is how much more memory the fleet needs and
    `part` names what does not fit ("layers 22-29", "embedding"), so a caller
    can say more than the message without parsing it.
    """

    code = "shard_unavailable"

    def __init__(self, message: str, *, missing_bytes: int | None = None, part: str | None = None):
        super().__init__(message)
        self.missing_bytes = missing_bytes
        self.part = part


class WeightsMismatch(MeshError):
    code = "weights_mismatch"


class ShardCorrupt(MeshError):
    """A stage sent activations with NaN/Inf or the wrong shape/dtype."""

    code = "shard_corrupt"


class PipelineStalled(MeshError):
    code = "pipeline_stalled"


class AuthError(MeshError):
    code = "unauthenticated"


class BadRequest(MeshError):
    """A request's parameters are malformed (non-positive context, batch, ...)."""

    code = "bad_request"


class KeyFileError(AuthError):
    """The cluster key file is missing, unreadable or not a key."""

    code = "bad_key_file"


class InvalidCard(MeshError):
    """A capability card from a peer has absurd or oversized values; it is dropped."""

    code = "invalid_card"


class MalformedMessage(MeshError):
    """A wire message is too large, has too many entries or cannot be decoded."""

    code = "malformed_message"


class MalformedTensor(ShardCorrupt):
    """A tensor's bytes do not match its dtype and shape, or the dtype is unknown."""


class PeerUnreachable(MeshError):
    """A peer did not answer a gRPC call in time or refused the connection."""

    code = "peer_unreachable"


class BindFailed(MeshError):
    """A node could not listen on the address it was given."""

    code = "bind_failed"


class RequestTimeout(MeshError):
    """A request ran past its deadline (the API's --request-timeout); its sequences were cancelled."""

    code = "request_timeout"


class UnknownModel(MeshError):
    """A request names a model this server does not serve."""

    code = "model_not_found"


class NotFound(MeshError):
    """A request names a stored object (a response) this server does not hold."""

    code = "not_found"


class RequestTooLarge(BadRequest):
    """An HTTP request body over the API's --max-body-mib, refused before it is read."""

    code = "request_too_large"


class InvalidAPIKey(AuthError):
    """An HTTP request to the API carries no key or the wrong one (`--api-key`)."""

    code = "invalid_api_key"


class SequenceFailed(MeshError):
    """A sequence ended without finishing: a stage failed, or the server cancelled it."""

    code = "generation_failed"


class InvalidReply(MeshError):
    """A stage answered a step with something other than what the step asked for (missing,
    extra or misplaced tokens, drafts it claims to accept but that were not proposed)."""

    code = "invalid_reply"


class PlanLimitExceeded(MeshError):
    """A step asks more of a stage than the plan it was loaded for allows (more sequences, rows or
    positions than the plan's batch, step and context), or a node has no room for another stream."""

    code = "plan_limit_exceeded"


class LeaderDown(MeshError):
    """The leader's loop stopped after repeated internal errors; nothing more can be served until the
    server is restarted."""

    code = "leader_down"


class TensorParallelUnsplittable(BadRequest):
    """A model's head, KV-head, MLP or block counts cannot be divided over a tensor-parallel group."""

    code = "tp_unsplittable"


class TensorParallelFailed(MeshError):
    """A rank of a tensor-parallel group died, hung or left; the whole group (one stage) has failed."""

    code = "tp_group_failed"


class TensorParallelAborted(TensorParallelFailed):
    """This rank left its group unformed because another rank failed its Load (that rank's error is
    the cause: the leader reports it, and plans without that rank's node)."""

    code = "tp_group_aborted"

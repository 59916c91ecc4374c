"""transport: move bytes and tensors inside a torch.distributed group (no InputMetadata here).

- :func:`encode` / :func:`decode`: strict msgpack codec with a versioned, schema-stamped header.
- :class:`ShmRing`: one writer, N readers, fixed slots in shared memory, futex wake-ups.
- :class:`ObjectChannel`: broadcast a Python object, or a caller's raw frame, to a group, shared
  memory for same-host followers, a gloo group for the others.
- :class:`TensorChannel`: broadcast a list of tensors as one coalesced buffer in one collective.
"""

from .codec import CodecError, TensorDesc, decode, decode_body, encode, encode_body, schema_fingerprint
from .envs import ENV_TIMEOUT
from .errors import PeerError, RingClosedError
from .gather import background, start_gather
from .object_channel import ObjectChannel
from .shm_ring import ShmRing, ShmRingHandle, ring_from_process_group
from .tensor_channel import TensorChannel

__all__ = [
    "CodecError",
    "TensorDesc",
    "encode",
    "decode",
    "encode_body",
    "decode_body",
    "schema_fingerprint",
    "ENV_TIMEOUT",
    "PeerError",
    "RingClosedError",
    "ShmRing",
    "ShmRingHandle",
    "ring_from_process_group",
    "ObjectChannel",
    "start_gather",
    "background",
    "TensorChannel",
]

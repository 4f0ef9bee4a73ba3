"""The UCCL-P2P-compatible module: ``from tcpx_p2p import p2p``.

Applications written for ``from uccl import p2p`` run with only the import
changed. Calls that return ``False`` log the reason to the ``tcpx_p2p``
logger and keep it for ``Endpoint.last_error()``.
"""

from ._native import (  # noqa: F401
    ConfigError,
    ConnectError,
    ConnectionLostError,
    CudaError,
    Endpoint,
    FloatType,
    InvalidArgumentError,
    RefusedError,
    TcpxP2PError,
    XferDesc,
    get_oob_ip,
)

# UCCL exposes a handle type for transfers; ours are plain integer ids.
XferHandle = int

# UCCL's FloatType values are also names of the module (p2p.kBFloat16).
kUndefined = FloatType.kUndefined
kFloat16 = FloatType.kFloat16
kBFloat16 = FloatType.kBFloat16
kFloat32 = FloatType.kFloat32
kFloat8E4M3FN = FloatType.kFloat8E4M3FN
kFloat8E5M2 = FloatType.kFloat8E5M2

__all__ = ["Endpoint", "XferDesc", "XferHandle", "FloatType", "get_oob_ip"]

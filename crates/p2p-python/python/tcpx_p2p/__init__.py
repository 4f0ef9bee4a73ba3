"""tcpx-p2p: GPU peer-to-peer transfers over TCP and GPUDirect-TCPX.

``from tcpx_p2p import p2p`` gives the same API as UCCL's ``from uccl import p2p``.
"""

import logging as _logging

from . import p2p
from ._native import (
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
    __version__,
    cuda_device_count,
    get_oob_ip,
)

_logging.getLogger("tcpx_p2p").addHandler(_logging.NullHandler())

__all__ = [
    "p2p",
    "Endpoint",
    "XferDesc",
    "FloatType",
    "get_oob_ip",
    "cuda_device_count",
    "TcpxP2PError",
    "InvalidArgumentError",
    "ConnectError",
    "ConnectionLostError",
    "RefusedError",
    "CudaError",
    "ConfigError",
    "__version__",
]

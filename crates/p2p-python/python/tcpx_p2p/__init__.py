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
    ProtocolError,
    RefusedError,
    TcpxP2PError,
    TimedOutError,
    XferDesc,
    __version__,
    cuda_device_count,
    get_oob_ip,
)

_logging.getLogger("tcpx_p2p").addHandler(_logging.NullHandler())


def emulator_plugin_path() -> str:
    """Absolute path of the bundled TCPX stand-in ncclNet plugin
    (``libnccl_net_emu.so``): set ``TCPX_P2P_NET=plugin`` and
    ``TCPX_P2P_PLUGIN_PATH`` to it, or hand it to NCCL as ``NCCL_NET_PLUGIN``."""
    import os

    p = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libnccl_net_emu.so")
    if not os.path.isfile(p):
        raise FileNotFoundError(f"{p}: the stand-in plugin is not part of this install")
    return p


def nixl_plugin_dir() -> str:
    """Absolute path of the folder holding the bundled NIXL backend plugin
    (``libplugin_TCPX_P2P.so``, backend name ``TCPX_P2P``): set
    ``NIXL_PLUGIN_DIR`` to it before the first NIXL agent is created."""
    import os

    d = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nixl")
    if not os.path.isfile(os.path.join(d, "libplugin_TCPX_P2P.so")):
        raise FileNotFoundError(f"{d}: the NIXL plugin is not part of this install")
    return d

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
    "ProtocolError",
    "TimedOutError",
    "CudaError",
    "ConfigError",
    "emulator_plugin_path",
    "nixl_plugin_dir",
    "__version__",
]

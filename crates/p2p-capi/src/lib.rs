//! The C API of tcpx-p2p (`include/tcpx_p2p.h`): `extern "C"` functions over
//! [`tcpx_p2p::Endpoint`]. Every body runs behind a panic boundary, every
//! pointer is checked, handles are opaque boxes, and engine errors become
//! [`Status`] codes in one function ([`status_of`]).

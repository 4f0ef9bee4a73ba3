// Our own declarations of the part of NIXL's backend-plugin interface that a
// network backend needs (NIXL plugin API version 1, as shipped in the
// nixl-cu12 / nixl-cu13 1.5.1 wheels: x86-64, libstdc++ with the cxx11 string
// ABI). NIXL's headers are not in any package registry; the agent and a
// plugin meet only through object layout and virtual-table order, so what
// matters is that every size, offset and slot below is the one libnixl was
// compiled with. Each is pinned by a static_assert at the end of this file.
//
// NIXL's name for each type is given beside ours. Only what a backend reads
// or fills in is declared: descriptor lists are read-only views, never
// constructed or destroyed here.

#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace nixl {

// nixl_status_t
enum Status : int {
    IN_PROG = 1,
    SUCCESS = 0,
    ERR_NOT_POSTED = -1,
    ERR_INVALID_PARAM = -2,
    ERR_BACKEND = -3,
    ERR_NOT_FOUND = -4,
    ERR_MISMATCH = -5,
    ERR_NOT_ALLOWED = -6,
    ERR_REPOST_ACTIVE = -7,
    ERR_UNKNOWN = -8,
    ERR_NOT_SUPPORTED = -9,
    ERR_REMOTE_DISCONNECT = -10,
    ERR_CANCELED = -11,
};

// nixl_mem_t
enum MemType : int { DRAM_SEG = 0, VRAM_SEG = 1, BLK_SEG = 2, OBJ_SEG = 3, FILE_SEG = 4 };

// nixl_xfer_op_t
enum XferOp : int { READ = 0, WRITE = 1 };

using Params = std::unordered_map<std::string, std::string>;  // nixl_b_params_t
using MemList = std::vector<MemType>;                          // nixl_mem_list_t
using NotifList = std::vector<std::pair<std::string, std::string>>;  // notif_list_t

// nixlBasicDesc: one contiguous range.
struct BasicDesc {
    uintptr_t addr;
    size_t len;
    uint64_t dev_id;
};

// nixlBackendMD: the polymorphic base of a backend's metadata objects (the
// ones registerMem / loadRemoteMD / loadLocalMD hand to the agent).
class BackendMD {
  public:
    explicit BackendMD(bool is_private) : is_private_(is_private) {}
    virtual ~BackendMD() {}

  protected:
    bool is_private_;
};

// nixlBackendReqH: the polymorphic base of a backend's transfer handles.
class BackendReqH {
  public:
    BackendReqH() {}
    virtual ~BackendReqH() {}
};

// nixlMetaDesc: a range and the metadata object the agent found for it.
struct MetaDesc : BasicDesc {
    BackendMD *metadata;
};

// nixlBlobDesc: a range and a blob (the peer's public data in loadRemoteMD).
struct BlobDesc : BasicDesc {
    std::string meta_info;
};

// nixlDescList<nixlMetaDesc> (nixl_meta_dlist_t), read only. The real class
// is polymorphic; its vtable pointer is only skipped here.
struct MetaDescList {
    const void *vptr_;
    MemType type;
    std::vector<MetaDesc> descs;
};

// nixlBackendOptionalArgs (nixl_opt_b_args_t)
struct OptArgs {
    std::string notif_msg;
    bool has_notif;
    std::string custom_param;
};

// nixl_thread_sync_t
enum class ThreadSync : int { NONE = 0, STRICT = 1, RW = 2 };

// nixlBackendInitParams
struct InitParams {
    std::string local_agent;
    std::string type;
    Params *custom_params;
    bool enable_prog_thread;
    uint64_t prog_thread_delay_us;
    ThreadSync sync_mode;
    bool enable_telemetry;
};

// nixlTelemetryEvent is never created by this backend; the base class's
// vector of them stays empty (only its three pointers matter).
struct TelemetryEventUnused;

// nixlBackendEngine. The agent reads the data members through inline
// accessors compiled into libnixl, and calls the virtual functions by slot,
// so both orders below are fixed.
class BackendEngine {
  public:
    explicit BackendEngine(const InitParams *p)
        : backend_type_(p->type),
          custom_params_(*p->custom_params),
          local_agent_(p->local_agent),
          enable_telemetry_(p->enable_telemetry) {}
    BackendEngine(const BackendEngine &) = delete;
    BackendEngine &operator=(const BackendEngine &) = delete;

    virtual ~BackendEngine() = default;  // slots 0 and 1

    virtual bool supportsRemote() const = 0;   // 2
    virtual bool supportsLocal() const = 0;    // 3
    virtual bool supportsNotif() const = 0;    // 4
    virtual MemList getSupportedMems() const = 0;  // 5

    virtual Status registerMem(const BlobDesc &mem, const MemType &mem_type,
                               BackendMD *&out) = 0;  // 6
    virtual Status deregisterMem(BackendMD *md) = 0;  // 7
    virtual Status connect(const std::string &remote_agent) = 0;     // 8
    virtual Status disconnect(const std::string &remote_agent) = 0;  // 9
    virtual Status unloadMD(BackendMD *md) = 0;                      // 10

    virtual Status prepXfer(const XferOp &op, const MetaDescList &local,
                            const MetaDescList &remote, const std::string &remote_agent,
                            BackendReqH *&handle, const OptArgs *opt) const = 0;  // 11
    virtual Status postXfer(const XferOp &op, const MetaDescList &local,
                            const MetaDescList &remote, const std::string &remote_agent,
                            BackendReqH *&handle, const OptArgs *opt) const = 0;  // 12
    virtual Status checkXfer(BackendReqH *handle) const = 0;    // 13
    virtual Status releaseReqH(BackendReqH *handle) const = 0;  // 14

    // Memory views (15: remote list, 16: local list, 17: release): not
    // offered. Their argument types do not matter to a backend that refuses.
    virtual Status prepMemViewRemote(const void *, void *&, const OptArgs *) const {
        return ERR_NOT_SUPPORTED;
    }
    virtual Status prepMemViewLocal(const void *, void *&, const OptArgs *) const {
        return ERR_NOT_SUPPORTED;
    }
    virtual void releaseMemView(void *) const {}

    virtual Status getPublicData(const BackendMD *md, std::string &out) const {  // 18
        (void)md;
        (void)out;
        return ERR_BACKEND;
    }
    virtual Status getConnInfo(std::string &out) const {  // 19
        (void)out;
        return ERR_BACKEND;
    }
    virtual Status loadRemoteConnInfo(const std::string &remote_agent,
                                      const std::string &conn_info) {  // 20
        (void)remote_agent;
        (void)conn_info;
        return ERR_BACKEND;
    }
    virtual Status loadRemoteMD(const BlobDesc &in, const MemType &mem_type,
                                const std::string &remote_agent, BackendMD *&out) {  // 21
        (void)in;
        (void)mem_type;
        (void)remote_agent;
        (void)out;
        return ERR_BACKEND;
    }
    virtual Status loadLocalMD(BackendMD *in, BackendMD *&out) {  // 22
        (void)in;
        (void)out;
        return ERR_BACKEND;
    }
    virtual Status getNotifs(NotifList &out) {  // 23
        (void)out;
        return ERR_BACKEND;
    }
    virtual Status genNotif(const std::string &remote_agent,
                            const std::string &msg) const {  // 24
        (void)remote_agent;
        (void)msg;
        return ERR_BACKEND;
    }
    // 25 queryMem, 26 estimateXferCost: not offered.
    virtual Status queryMem(const void *, void *) const { return ERR_NOT_SUPPORTED; }
    virtual Status estimateXferCost(const void *, const void *, const void *, const void *,
                                    const void *, void *, void *, void *,
                                    const void *) const {
        return ERR_NOT_SUPPORTED;
    }

  private:
    std::string backend_type_;
    Params custom_params_;
    std::vector<TelemetryEventUnused *> telemetry_events_;
    std::mutex telemetry_mutex_;

  protected:
    bool init_err_ = false;  // the agent drops an engine that sets it
    const std::string local_agent_;
    const bool enable_telemetry_;

    const Params &custom_params() const { return custom_params_; }

    friend struct LayoutCheck;
};

// nixlBackendPlugin: what nixl_plugin_init returns.
struct Plugin {
    int api_version;
    BackendEngine *(*create_engine)(const InitParams *);
    void (*destroy_engine)(BackendEngine *);
    const char *(*get_plugin_name)();
    const char *(*get_plugin_version)();
    Params (*get_backend_options)();
    MemList (*get_backend_mems)();
};

constexpr int PLUGIN_API_VERSION = 1;

// The layout libnixl 1.5.1 was built with. offsetof on a class that is not
// standard-layout (derived with members, polymorphic) is "conditionally
// supported"; GCC gives the real offsets, which is what these checks want.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
struct LayoutCheck {
    static_assert(sizeof(std::string) == 32, "libstdc++ cxx11 std::string expected");
    static_assert(sizeof(Params) == 56, "libstdc++ unordered_map expected");
    static_assert(sizeof(std::mutex) == 40, "glibc x86-64 std::mutex expected");

    static_assert(sizeof(BasicDesc) == 24, "nixlBasicDesc");
    static_assert(sizeof(MetaDesc) == 32 && offsetof(MetaDesc, metadata) == 24, "nixlMetaDesc");
    static_assert(sizeof(BlobDesc) == 56 && offsetof(BlobDesc, meta_info) == 24,
                  "nixlBlobDesc");
    static_assert(offsetof(MetaDescList, type) == 8 && offsetof(MetaDescList, descs) == 16 &&
                      sizeof(MetaDescList) == 40,
                  "nixlDescList<nixlMetaDesc>");
    static_assert(offsetof(OptArgs, notif_msg) == 0 && offsetof(OptArgs, has_notif) == 32 &&
                      offsetof(OptArgs, custom_param) == 40,
                  "nixlBackendOptionalArgs");
    static_assert(offsetof(InitParams, local_agent) == 0 && offsetof(InitParams, type) == 32 &&
                      offsetof(InitParams, custom_params) == 64 &&
                      offsetof(InitParams, enable_prog_thread) == 72 &&
                      offsetof(InitParams, prog_thread_delay_us) == 80 &&
                      offsetof(InitParams, sync_mode) == 88 &&
                      offsetof(InitParams, enable_telemetry) == 92,
                  "nixlBackendInitParams");
    static_assert(offsetof(Plugin, create_engine) == 8 && offsetof(Plugin, get_backend_mems) == 48,
                  "nixlBackendPlugin");

    static_assert(sizeof(BackendEngine) == 208, "nixlBackendEngine size");
    static_assert(offsetof(BackendEngine, backend_type_) == 8, "backendType");
    static_assert(offsetof(BackendEngine, custom_params_) == 40, "customParams");
    static_assert(offsetof(BackendEngine, telemetry_events_) == 96, "telemetryEvents_");
    static_assert(offsetof(BackendEngine, telemetry_mutex_) == 120, "telemetryEventsMutex_");
    static_assert(offsetof(BackendEngine, init_err_) == 160, "initErr");
    static_assert(offsetof(BackendEngine, local_agent_) == 168, "localAgent");
    static_assert(offsetof(BackendEngine, enable_telemetry_) == 200, "enableTelemetry_");
    static_assert(sizeof(BackendMD) == 16, "nixlBackendMD");
    static_assert(sizeof(BackendReqH) == 8, "nixlBackendReqH");
};
#pragma GCC diagnostic pop

}  // namespace nixl

// The TCPX_P2P backend engine for NIXL, over the engine's C API
// (include/tcpx_p2p.h). One tcpx endpoint per NIXL backend instance: its
// listener is up from the constructor on, its metadata is our connection
// info, each registration's exported descriptor is our public data, and a
// NIXL transfer is one vector write or read of the C API (one transfer id,
// its notification sent by the engine after every byte has landed).

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "nixl_abi.hpp"
#include "tcpx_p2p.h"

namespace {

using nixl::Status;

constexpr const char *PLUGIN_NAME = "TCPX_P2P";
constexpr const char *PLUGIN_VERSION = "0.1.0";
// How long releaseReqH lets a transfer whose data is already moving run
// to its end before it ends it with its connection.
constexpr int64_t kCancelWaitMs = 2000;

// Backend parameters (create_backend(name, params)), each passed to the
// engine's config under the same name. Unset ones keep the engine's
// defaults, which the TCPX_P2P_* environment variables override.
const char *const PARAM_KEYS[] = {
    "net",          "plugin_path", "streams",     "channels",           "chunk",
    "interface",    "port",        "auth_token",  "gpu",                "deadline_ms",
    "keepalive_ms", "connect_timeout_ms",
};

void log_failure(const char *what, tcpx_status_t st) {
    std::fprintf(stderr, "TCPX_P2P: %s: %s (%s)\n", what, tcpx_status_str(st), tcpx_last_error());
}

Status to_nixl(tcpx_status_t st) {
    switch (st) {
    case TCPX_OK:
        return nixl::SUCCESS;
    case TCPX_AGAIN:
        return nixl::IN_PROG;
    case TCPX_ERR_INVALID_ARGUMENT:
    case TCPX_ERR_MALFORMED:
    case TCPX_ERR_BUFFER_TOO_SMALL:
        return nixl::ERR_INVALID_PARAM;
    case TCPX_ERR_UNKNOWN_ID:
        return nixl::ERR_NOT_FOUND;
    case TCPX_ERR_REFUSED:
        return nixl::ERR_NOT_ALLOWED;
    case TCPX_ERR_CONNECT:
    case TCPX_ERR_CONNECTION_LOST:
    case TCPX_ERR_TIMEOUT:
        return nixl::ERR_REMOTE_DISCONNECT;
    default:
        return nixl::ERR_BACKEND;
    }
}

// The GPU whose CUDA context is current on the calling thread (what the
// application chose with cudaSetDevice / torch.cuda.set_device), or -1 when
// CUDA is absent or not initialised here. Asked of the driver at run time:
// the plugin needs no CUDA library to load.
int current_cuda_device() {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (lib == nullptr) return -1;  // not loaded by the application: no GPU in use
    using GetCurrent = int (*)(void **);
    using GetDevice = int (*)(int *);
    auto get_current = reinterpret_cast<GetCurrent>(dlsym(lib, "cuCtxGetCurrent"));
    auto get_device = reinterpret_cast<GetDevice>(dlsym(lib, "cuCtxGetDevice"));
    int dev = -1;
    void *ctx = nullptr;
    if (get_current != nullptr && get_device != nullptr && get_current(&ctx) == 0 &&
        ctx != nullptr && get_device(&dev) != 0) {
        dev = -1;
    }
    dlclose(lib);
    return dev;
}

// What registerMem hands the agent: our registration of a local range and
// the descriptor that offers all of it to peers (our public data).
struct LocalMD : nixl::BackendMD {
    LocalMD() : nixl::BackendMD(true) {}
    uint64_t mr = 0;
    uintptr_t addr = 0;
    size_t len = 0;
    uint8_t desc[TCPX_DESC_LEN] = {};
};

// What loadRemoteMD (a peer's region) and loadLocalMD (our own region, for
// transfers to self) hand the agent: whose region, its range and the
// descriptor that names it.
struct RemoteMD : nixl::BackendMD {
    RemoteMD() : nixl::BackendMD(false) {}
    std::string agent;
    uint64_t addr = 0;
    uint64_t len = 0;
    uint8_t desc[TCPX_DESC_LEN] = {};
};

// A prepared transfer: its pieces, checked once, and its latest posting.
struct Request : nixl::BackendReqH {
    nixl::XferOp op = nixl::WRITE;
    std::string agent;
    std::vector<tcpx_rma_iov_t> iov;
    // The descriptors the pieces point into (kept here so that a re-post
    // does not depend on the agent's metadata objects).
    std::vector<std::unique_ptr<uint8_t[]>> descs;
    bool active = false;  // posted and not yet seen to end
    uint64_t xfer = 0;
    uint64_t conn = 0;
    Status last = nixl::ERR_NOT_POSTED;
};

// `[addr, addr+len)` lies inside `[base, base+size)` (no overflow).
bool inside(uint64_t addr, uint64_t len, uint64_t base, uint64_t size) {
    return addr >= base && addr - base <= size && len <= size - (addr - base);
}

class Engine final : public nixl::BackendEngine {
  public:
    explicit Engine(const nixl::InitParams *p) : nixl::BackendEngine(p) {
        init_err_ = !init();
    }

    ~Engine() override {
        tcpx_endpoint_destroy(ep_);
    }

    bool failed() const { return init_err_; }

    bool supportsRemote() const override { return true; }
    bool supportsLocal() const override { return true; }
    bool supportsNotif() const override { return true; }
    nixl::MemList getSupportedMems() const override { return {nixl::DRAM_SEG, nixl::VRAM_SEG}; }

    Status registerMem(const nixl::BlobDesc &mem, const nixl::MemType &type,
                       nixl::BackendMD *&out) override try {
        if (type != nixl::DRAM_SEG && type != nixl::VRAM_SEG) return nixl::ERR_NOT_SUPPORTED;
        if (mem.addr == 0 || mem.len == 0) return nixl::ERR_INVALID_PARAM;
        // The descriptor's devId is not trusted to be a CUDA ordinal (vLLM
        // puts its TP rank there): the engine asks CUDA about the pointer.
        if (type == nixl::VRAM_SEG && gpu_ < 0) {
            std::fprintf(stderr,
                         "TCPX_P2P: GPU memory, but this backend has no GPU (set the backend "
                         "parameter gpu, or create the agent after selecting the GPU)\n");
            return nixl::ERR_NOT_SUPPORTED;
        }
        auto md = std::make_unique<LocalMD>();
        md->addr = mem.addr;
        md->len = mem.len;
        tcpx_status_t st = tcpx_reg(ep_, reinterpret_cast<void *>(mem.addr), mem.len, &md->mr);
        if (st != TCPX_OK) {
            log_failure("registering memory", st);
            return to_nixl(st);
        }
        st = tcpx_export(ep_, md->mr, md->desc);
        if (st != TCPX_OK) {
            log_failure("exporting a registration", st);
            tcpx_dereg(ep_, md->mr);
            return to_nixl(st);
        }
        out = md.release();
        return nixl::SUCCESS;
    } catch (const std::exception &) {
        return nixl::ERR_BACKEND;
    }

    Status deregisterMem(nixl::BackendMD *md) override {
        auto *local = dynamic_cast<LocalMD *>(md);
        if (local == nullptr) return nixl::ERR_INVALID_PARAM;
        tcpx_status_t st = tcpx_dereg(ep_, local->mr);
        if (st != TCPX_OK) log_failure("deregistering memory", st);
        delete local;
        return to_nixl(st);
    }

    Status connect(const std::string &agent) override try {
        uint64_t conn = 0;
        return conn_for(agent, conn);
    } catch (const std::exception &) {
        return nixl::ERR_BACKEND;
    }

    Status disconnect(const std::string &agent) override try {
        uint64_t conn = 0;
        {
            std::lock_guard<std::mutex> g(mu_);
            auto it = conns_.find(agent);
            if (it == conns_.end()) return nixl::SUCCESS;
            conn = it->second;
            conns_.erase(it);
        }
        tcpx_status_t st = tcpx_disconnect(ep_, conn);
        // A connection the engine already dropped is as good as closed.
        return st == TCPX_ERR_UNKNOWN_ID || st == TCPX_ERR_CONNECTION_LOST ? nixl::SUCCESS
                                                                          : to_nixl(st);
    } catch (const std::exception &) {
        return nixl::ERR_BACKEND;
    }

    Status unloadMD(nixl::BackendMD *md) override {
        auto *remote = dynamic_cast<RemoteMD *>(md);
        if (remote == nullptr) return nixl::ERR_INVALID_PARAM;
        delete remote;
        return nixl::SUCCESS;
    }

    Status prepXfer(const nixl::XferOp &op, const nixl::MetaDescList &local,
                    const nixl::MetaDescList &remote, const std::string &agent,
                    nixl::BackendReqH *&handle, const nixl::OptArgs *) const override try {
        auto req = std::make_unique<Request>();
        Status s = build(op, local, remote, agent, *req);
        if (s != nixl::SUCCESS) return s;
        handle = req.release();
        return nixl::SUCCESS;
    } catch (const std::exception &) {
        return nixl::ERR_BACKEND;
    }

    Status postXfer(const nixl::XferOp &op, const nixl::MetaDescList &local,
                    const nixl::MetaDescList &remote, const std::string &agent,
                    nixl::BackendReqH *&handle, const nixl::OptArgs *opt) const override try {
        if (handle == nullptr) {
            Status s = prepXfer(op, local, remote, agent, handle, opt);
            if (s != nixl::SUCCESS) return s;
        }
        auto *req = dynamic_cast<Request *>(handle);
        if (req == nullptr) return nixl::ERR_INVALID_PARAM;
        if (req->active) {
            // A handle is re-posted only once its last posting has ended.
            Status s = poll(*req);
            if (s == nixl::IN_PROG) return nixl::ERR_REPOST_ACTIVE;
        }
        uint64_t conn = 0;
        Status s = conn_for(req->agent, conn);
        if (s != nixl::SUCCESS) return req->last = s;
        const void *notif = nullptr;
        size_t notif_len = 0;
        if (opt != nullptr && opt->has_notif) {
            notif = opt->notif_msg.data();
            notif_len = opt->notif_msg.size();
        }
        uint64_t xfer = 0;
        tcpx_status_t st =
            req->op == nixl::WRITE
                ? tcpx_writev_async(ep_, conn, req->iov.data(), req->iov.size(), notif, notif_len, &xfer)
                : tcpx_readv_async(ep_, conn, req->iov.data(), req->iov.size(), notif, notif_len, &xfer);
        if (st != TCPX_OK) {
            log_failure(req->op == nixl::WRITE ? "posting a write" : "posting a read", st);
            forget_conn(req->agent, conn, st);
            return req->last = to_nixl(st);
        }
        req->active = true;
        req->xfer = xfer;
        req->conn = conn;
        req->last = nixl::IN_PROG;
        return poll(*req);
    } catch (const std::exception &) {
        return nixl::ERR_BACKEND;
    }

    Status checkXfer(nixl::BackendReqH *handle) const override {
        auto *req = dynamic_cast<Request *>(handle);
        if (req == nullptr) return nixl::ERR_INVALID_PARAM;
        return req->active ? poll(*req) : req->last;
    }

    Status releaseReqH(nixl::BackendReqH *handle) const override {
        auto *req = dynamic_cast<Request *>(handle);
        if (req == nullptr) return nixl::ERR_INVALID_PARAM;
        if (req->active && poll(*req) == nixl::IN_PROG) {
            // Abort this transfer alone: called back if none of its data
            // has moved, else run to its end (bounded), so that no byte
            // touches the handle's buffers once it is released.
            if (tcpx_cancel(ep_, req->xfer, kCancelWaitMs) == TCPX_ERR_TIMEOUT) {
                // Still moving data: end it with its connection (the next
                // transfer to that agent connects again).
                forget_conn(req->agent, req->conn, TCPX_ERR_CONNECTION_LOST);
                tcpx_disconnect(ep_, req->conn);
                if (tcpx_wait(ep_, req->xfer, 10000) == TCPX_ERR_TIMEOUT) tcpx_release(ep_, req->xfer);
            }
        }
        delete req;
        return nixl::SUCCESS;
    }

    Status getPublicData(const nixl::BackendMD *md, std::string &out) const override try {
        auto *local = dynamic_cast<const LocalMD *>(md);
        if (local == nullptr) return nixl::ERR_INVALID_PARAM;
        out.assign(reinterpret_cast<const char *>(local->desc), TCPX_DESC_LEN);
        return nixl::SUCCESS;
    } catch (const std::exception &) {
        return nixl::ERR_BACKEND;
    }

    Status getConnInfo(std::string &out) const override try {
        out = own_metadata_;
        return nixl::SUCCESS;
    } catch (const std::exception &) {
        return nixl::ERR_BACKEND;
    }

    Status loadRemoteConnInfo(const std::string &agent, const std::string &info) override try {
        if (info.empty() || info.size() > TCPX_METADATA_MAX) return nixl::ERR_INVALID_PARAM;
        std::lock_guard<std::mutex> g(mu_);
        auto it = conn_info_.find(agent);
        if (it != conn_info_.end() && it->second != info) conns_.erase(agent);
        conn_info_[agent] = info;
        return nixl::SUCCESS;
    } catch (const std::exception &) {
        return nixl::ERR_BACKEND;
    }

    Status loadRemoteMD(const nixl::BlobDesc &in, const nixl::MemType &,
                        const std::string &agent, nixl::BackendMD *&out) override try {
        if (in.meta_info.size() != TCPX_DESC_LEN) return nixl::ERR_INVALID_PARAM;
        auto md = std::make_unique<RemoteMD>();
        std::memcpy(md->desc, in.meta_info.data(), TCPX_DESC_LEN);
        tcpx_status_t st = tcpx_desc_info(md->desc, &md->addr, &md->len);
        if (st != TCPX_OK) return to_nixl(st);
        md->agent = agent;
        out = md.release();
        return nixl::SUCCESS;
    } catch (const std::exception &) {
        return nixl::ERR_BACKEND;
    }

    Status loadLocalMD(nixl::BackendMD *in, nixl::BackendMD *&out) override try {
        auto *local = dynamic_cast<LocalMD *>(in);
        if (local == nullptr) return nixl::ERR_INVALID_PARAM;
        auto md = std::make_unique<RemoteMD>();
        md->agent = local_agent_;
        md->addr = local->addr;
        md->len = local->len;
        std::memcpy(md->desc, local->desc, TCPX_DESC_LEN);
        out = md.release();
        return nixl::SUCCESS;
    } catch (const std::exception &) {
        return nixl::ERR_BACKEND;
    }

    Status getNotifs(nixl::NotifList &out) override try {
        drain_accepted();
        tcpx_notifs_t *list = nullptr;
        tcpx_status_t st = tcpx_get_notifs(ep_, &list);
        if (st != TCPX_OK) return to_nixl(st);
        size_t n = tcpx_notifs_count(list);
        for (size_t i = 0; i < n; i++) {
            tcpx_notif_t v;
            if (tcpx_notifs_at(list, i, &v) != TCPX_OK) continue;
            out.emplace_back(std::string(v.name, v.name_len),
                             std::string(reinterpret_cast<const char *>(v.msg), v.msg_len));
        }
        tcpx_notifs_free(list);
        return nixl::SUCCESS;
    } catch (const std::exception &) {
        return nixl::ERR_BACKEND;
    }

    Status genNotif(const std::string &agent, const std::string &msg) const override try {
        uint64_t conn = 0;
        Status s = conn_for(agent, conn);
        if (s != nixl::SUCCESS) return s;
        tcpx_status_t st = tcpx_send_notif(ep_, conn, msg.data(), msg.size());
        if (st != TCPX_OK) {
            log_failure("sending a notification", st);
            forget_conn(agent, conn, st);
        }
        return to_nixl(st);
    } catch (const std::exception &) {
        return nixl::ERR_BACKEND;
    }

  private:
    bool init() {
        tcpx_config_t *cfg = nullptr;
        tcpx_status_t st = tcpx_config_new(&cfg);
        if (st != TCPX_OK) {
            log_failure("reading the TCPX_P2P_* environment", st);
            return false;
        }
        std::unique_ptr<tcpx_config_t, void (*)(tcpx_config_t *)> guard(cfg, tcpx_config_free);
        for (const auto &kv : custom_params()) {
            bool known = false;
            for (const char *k : PARAM_KEYS) known = known || kv.first == k;
            if (!known) {
                std::fprintf(stderr, "TCPX_P2P: unknown backend parameter \"%s\"\n",
                             kv.first.c_str());
                return false;
            }
            st = tcpx_config_set(cfg, kv.first.c_str(), kv.second.c_str());
            if (st != TCPX_OK) {
                log_failure(("backend parameter " + kv.first).c_str(), st);
                return false;
            }
        }
        // The GPU: the parameter, else the one current on this thread.
        auto g = custom_params().find("gpu");
        if (g != custom_params().end()) {
            gpu_ = std::atoi(g->second.c_str());
        } else {
            gpu_ = current_cuda_device();
            if (gpu_ >= 0) {
                st = tcpx_config_set(cfg, "gpu", std::to_string(gpu_).c_str());
                if (st != TCPX_OK) {
                    log_failure("the current GPU", st);
                    return false;
                }
            }
        }
        // Notifications carry the sender's endpoint name: the agent's name.
        st = tcpx_config_set(cfg, "name", local_agent_.c_str());
        if (st != TCPX_OK) {
            log_failure("the agent's name as the endpoint name", st);
            return false;
        }
        st = tcpx_endpoint_create(cfg, &ep_);
        if (st != TCPX_OK) {
            log_failure("creating the endpoint", st);
            return false;
        }
        uint8_t md[TCPX_METADATA_MAX];
        size_t len = sizeof md;
        st = tcpx_endpoint_metadata(ep_, md, &len);
        if (st != TCPX_OK) {
            log_failure("the endpoint's metadata", st);
            return false;
        }
        own_metadata_.assign(reinterpret_cast<const char *>(md), len);
        return true;
    }

    // The connection to `agent` (ourselves included), made on first use.
    Status conn_for(const std::string &agent, uint64_t &conn) const {
        std::string info;
        {
            std::lock_guard<std::mutex> g(mu_);
            auto c = conns_.find(agent);
            if (c != conns_.end()) {
                conn = c->second;
                return nixl::SUCCESS;
            }
            auto it = conn_info_.find(agent);
            if (it != conn_info_.end()) {
                info = it->second;
            } else if (agent == local_agent_) {
                info = own_metadata_;
            } else {
                return nixl::ERR_NOT_FOUND;
            }
        }
        // Connecting blocks (up to the engine's connect timeout): not under
        // the lock. The engine hands out one connection per metadata.
        tcpx_status_t st = tcpx_connect_metadata(
            ep_, reinterpret_cast<const uint8_t *>(info.data()), info.size(), &conn);
        if (st != TCPX_OK) {
            log_failure(("connecting to agent " + agent).c_str(), st);
            return to_nixl(st);
        }
        std::lock_guard<std::mutex> g(mu_);
        conns_[agent] = conn;
        return nixl::SUCCESS;
    }

    // After a failure on `conn`: a lost connection is made again next time.
    void forget_conn(const std::string &agent, uint64_t conn, tcpx_status_t why) const {
        if (why != TCPX_ERR_CONNECTION_LOST && why != TCPX_ERR_UNKNOWN_ID) return;
        std::lock_guard<std::mutex> g(mu_);
        auto it = conns_.find(agent);
        if (it != conns_.end() && it->second == conn) conns_.erase(it);
    }

    // Peers that connected to us need nothing from us: one-sided requests
    // and notifications are served by the engine. Take them off its queue.
    void drain_accepted() const {
        tcpx_accepted_t a;
        while (tcpx_try_accept(ep_, &a) == TCPX_OK) {
        }
    }

    Status poll(Request &req) const {
        tcpx_status_t st = tcpx_poll(ep_, req.xfer);
        if (st == TCPX_AGAIN) return nixl::IN_PROG;
        req.active = false;
        if (st != TCPX_OK) {
            log_failure(req.op == nixl::WRITE ? "a write" : "a read", st);
            forget_conn(req.agent, req.conn, st);
        }
        return req.last = to_nixl(st);
    }

    // Checks every descriptor pair against our records before anything is
    // posted: a local range inside its registration, a remote range inside
    // the region the peer advertised, both of one length.
    Status build(nixl::XferOp op, const nixl::MetaDescList &local,
                 const nixl::MetaDescList &remote, const std::string &agent, Request &req) const {
        if (op != nixl::READ && op != nixl::WRITE) return nixl::ERR_INVALID_PARAM;
        const size_t n = local.descs.size();
        if (n == 0 || n != remote.descs.size()) return nixl::ERR_INVALID_PARAM;
        req.op = op;
        req.agent = agent;
        req.iov.reserve(n);
        // One copy of each distinct remote descriptor.
        std::unordered_map<const RemoteMD *, const uint8_t *> copied;
        // The metadata of the descriptor before, checked already: a KV list
        // names one region on each side thousands of times over, and its
        // descriptors are checked against the last ones' without a cast,
        // an agent comparison or a lookup (vLLM makes such a handle for
        // every request).
        const nixl::BackendMD *last_l = nullptr, *last_r = nullptr;
        const LocalMD *lmd = nullptr;
        const RemoteMD *rmd = nullptr;
        const uint8_t *rdesc = nullptr;
        for (size_t i = 0; i < n; i++) {
            const nixl::MetaDesc &l = local.descs[i];
            const nixl::MetaDesc &r = remote.descs[i];
            if (l.metadata != last_l || lmd == nullptr) {
                lmd = dynamic_cast<const LocalMD *>(l.metadata);
                if (lmd == nullptr) return nixl::ERR_INVALID_PARAM;
                last_l = l.metadata;
            }
            if (r.metadata != last_r || rmd == nullptr) {
                rmd = dynamic_cast<const RemoteMD *>(r.metadata);
                if (rmd == nullptr || rmd->agent != agent) return nixl::ERR_INVALID_PARAM;
                auto c = copied.find(rmd);
                if (c == copied.end()) {
                    std::unique_ptr<uint8_t[]> d(new uint8_t[TCPX_DESC_LEN]);
                    std::memcpy(d.get(), rmd->desc, TCPX_DESC_LEN);
                    c = copied.emplace(rmd, d.get()).first;
                    req.descs.push_back(std::move(d));
                }
                rdesc = c->second;
                last_r = r.metadata;
            }
            if (l.len != r.len || l.len == 0) return nixl::ERR_INVALID_PARAM;
            if (!inside(l.addr, l.len, lmd->addr, lmd->len)) return nixl::ERR_INVALID_PARAM;
            if (!inside(r.addr, r.len, rmd->addr, rmd->len)) return nixl::ERR_INVALID_PARAM;
            tcpx_rma_iov_t v;
            v.mr = lmd->mr;
            v.ptr = reinterpret_cast<void *>(l.addr);
            v.len = l.len;
            v.desc = rdesc;
            v.remote_offset = r.addr - rmd->addr;
            req.iov.push_back(v);
        }
        return nixl::SUCCESS;
    }

    tcpx_endpoint_t *ep_ = nullptr;
    int gpu_ = -1;  // the endpoint's GPU (-1: host memory only)
    std::string own_metadata_;
    mutable std::mutex mu_;
    std::unordered_map<std::string, std::string> conn_info_;  // agent -> its metadata
    mutable std::unordered_map<std::string, uint64_t> conns_;  // agent -> connection
};

nixl::BackendEngine *create_engine(const nixl::InitParams *p) {
    try {
        return new Engine(p);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "TCPX_P2P: creating the engine: %s\n", e.what());
        return nullptr;
    }
}

void destroy_engine(nixl::BackendEngine *e) { delete e; }

const char *plugin_name() { return PLUGIN_NAME; }
const char *plugin_version() { return PLUGIN_VERSION; }

nixl::Params backend_options() {
    nixl::Params p;
    for (const char *k : PARAM_KEYS) p.emplace(k, "");
    return p;
}

nixl::MemList backend_mems() { return {nixl::DRAM_SEG, nixl::VRAM_SEG}; }

nixl::Plugin PLUGIN = {
    nixl::PLUGIN_API_VERSION, create_engine, destroy_engine, plugin_name,
    plugin_version,           backend_options, backend_mems,
};

// The byte offset of a virtual function's slot in the vtable, from its
// pointer to member (Itanium C++ ABI: 1 + offset for a virtual function).
template <typename F>
long slot_of(F f) {
    struct Pmf {
        uintptr_t ptr;
        ptrdiff_t adj;
    } raw;
    static_assert(sizeof(F) == sizeof(Pmf), "Itanium pointer to member function");
    std::memcpy(&raw, &f, sizeof raw);
    return (raw.ptr & 1) ? static_cast<long>((raw.ptr - 1) / sizeof(void *)) : -1;
}

}  // namespace

extern "C" {

// What nixl_plugin_init (Rust) returns to the agent.
nixl::Plugin *tcpx_nixl_plugin(void) { return &PLUGIN; }

// 0 when every virtual function sits in the slot libnixl 1.5.1 calls; else
// the first slot found out of place (checked by a unit test).
int tcpx_nixl_check_slots(void) {
    using E = nixl::BackendEngine;
    const long want[][2] = {
        {slot_of(&E::supportsRemote), 2},     {slot_of(&E::supportsLocal), 3},
        {slot_of(&E::supportsNotif), 4},      {slot_of(&E::getSupportedMems), 5},
        {slot_of(&E::registerMem), 6},        {slot_of(&E::deregisterMem), 7},
        {slot_of(&E::connect), 8},            {slot_of(&E::disconnect), 9},
        {slot_of(&E::unloadMD), 10},          {slot_of(&E::prepXfer), 11},
        {slot_of(&E::postXfer), 12},          {slot_of(&E::checkXfer), 13},
        {slot_of(&E::releaseReqH), 14},       {slot_of(&E::prepMemViewRemote), 15},
        {slot_of(&E::prepMemViewLocal), 16},  {slot_of(&E::releaseMemView), 17},
        {slot_of(&E::getPublicData), 18},     {slot_of(&E::getConnInfo), 19},
        {slot_of(&E::loadRemoteConnInfo), 20}, {slot_of(&E::loadRemoteMD), 21},
        {slot_of(&E::loadLocalMD), 22},       {slot_of(&E::getNotifs), 23},
        {slot_of(&E::genNotif), 24},          {slot_of(&E::queryMem), 25},
        {slot_of(&E::estimateXferCost), 26},
    };
    for (const auto &w : want) {
        if (w[0] != w[1]) return static_cast<int>(w[1]);
    }
    return 0;
}

// The engine class driven as libnixl drives it, with no libnixl: the checks
// NIXL's own layer makes before ours (so the end-to-end tests cannot reach
// them), then a transfer to self with bytes compared, a re-post, a
// notification. 0 on success, else the line of the first failed check.
int tcpx_nixl_selftest(void) {
#define CHECK(c)                 \
    do {                         \
        if (!(c)) return __LINE__; \
    } while (0)
    using nixl::MetaDesc;
    using nixl::MetaDescList;
    nixl::Params params{{"interface", "lo"}, {"net", "socket"}};
    nixl::InitParams ip{};
    ip.local_agent = "selftest";
    ip.type = PLUGIN_NAME;
    ip.custom_params = &params;
    Engine e(&ip);
    CHECK(!e.failed());
    std::string info;
    CHECK(e.getConnInfo(info) == nixl::SUCCESS && !info.empty());

    constexpr size_t N = 64 * 1024, B = 4096, BLOCKS = N / B;
    std::vector<uint8_t> src(N), dst(N, 0);
    for (size_t i = 0; i < N; i++) src[i] = static_cast<uint8_t>(i * 131 + i / 977);
    nixl::BackendMD *smd = nullptr, *dmd = nullptr, *rdst = nullptr;
    auto blob = [](const std::vector<uint8_t> &v) {
        nixl::BlobDesc d;
        d.addr = reinterpret_cast<uintptr_t>(v.data());
        d.len = v.size();
        d.dev_id = 0;
        return d;
    };
    CHECK(e.registerMem(blob(src), nixl::DRAM_SEG, smd) == nixl::SUCCESS);
    CHECK(e.registerMem(blob(dst), nixl::DRAM_SEG, dmd) == nixl::SUCCESS);
    CHECK(e.registerMem(blob(dst), nixl::VRAM_SEG, rdst) == nixl::ERR_NOT_SUPPORTED);
    CHECK(e.loadLocalMD(dmd, rdst) == nixl::SUCCESS);
    std::string pub;
    CHECK(e.getPublicData(smd, pub) == nixl::SUCCESS && pub.size() == TCPX_DESC_LEN);

    const uintptr_t s0 = reinterpret_cast<uintptr_t>(src.data());
    const uintptr_t d0 = reinterpret_cast<uintptr_t>(dst.data());
    auto list = [](std::vector<MetaDesc> v) { return MetaDescList{nullptr, nixl::DRAM_SEG, std::move(v)}; };
    auto refused = [&](const MetaDescList &l, const MetaDescList &r, const std::string &agent) {
        nixl::BackendReqH *h = nullptr;
        return e.prepXfer(nixl::WRITE, l, r, agent, h, nullptr) == nixl::ERR_INVALID_PARAM && h == nullptr;
    };
    auto one = [](uintptr_t a, size_t n, nixl::BackendMD *md) { return MetaDesc{{a, n, 0}, md}; };
    // Past the peer's registration, past ours, lengths apart, another
    // agent's region, a local object where a remote one belongs, nothing.
    CHECK(refused(list({one(s0, B, smd)}), list({one(d0 + N - B / 2, B, rdst)}), "selftest"));
    CHECK(refused(list({one(s0 + N - B / 2, B, smd)}), list({one(d0, B, rdst)}), "selftest"));
    CHECK(refused(list({one(s0, B, smd)}), list({one(d0, B / 2, rdst)}), "selftest"));
    CHECK(refused(list({one(s0, B, smd)}), list({one(d0, B, rdst)}), "someone-else"));
    CHECK(refused(list({one(s0, B, smd)}), list({one(d0, B, dmd)}), "selftest"));
    CHECK(refused(list({}), list({}), "selftest"));
    // Only a later descriptor wrong, its metadata the same as the first's
    // (each descriptor's bounds are checked, not only the first's) or not
    // (a new metadata object is checked whole).
    CHECK(refused(list({one(s0, B, smd), one(s0 + B, B, smd)}),
                  list({one(d0, B, rdst), one(d0 + N - B / 2, B, rdst)}), "selftest"));
    CHECK(refused(list({one(s0, B, smd), one(s0 + N - B / 2, B, smd)}),
                  list({one(d0, B, rdst), one(d0 + B, B, rdst)}), "selftest"));
    CHECK(refused(list({one(s0, B, smd), one(s0 + B, B, smd)}),
                  list({one(d0, B, rdst), one(d0 + B, B, dmd)}), "selftest"));
    CHECK(refused(list({one(s0, B, smd), one(s0 + B, B, rdst)}),
                  list({one(d0, B, rdst), one(d0 + B, B, rdst)}), "selftest"));
    CHECK(refused(list({one(s0, B, smd), one(s0 + B, B, smd)}), list({one(d0, B, rdst)}), "selftest"));
    for (uint8_t b : dst) CHECK(b == 0);

    // Block i of src to block BLOCKS-1-i of dst, twice through one handle.
    std::vector<MetaDesc> l, r;
    for (size_t i = 0; i < BLOCKS; i++) {
        l.push_back(one(s0 + i * B, B, smd));
        r.push_back(one(d0 + (BLOCKS - 1 - i) * B, B, rdst));
    }
    MetaDescList ll = list(l), rl = list(r);
    nixl::BackendReqH *h = nullptr;
    CHECK(e.prepXfer(nixl::WRITE, ll, rl, "selftest", h, nullptr) == nixl::SUCCESS && h != nullptr);
    CHECK(e.checkXfer(h) == nixl::ERR_NOT_POSTED);
    nixl::OptArgs opt{"done", true, ""};
    for (int round = 0; round < 2; round++) {
        Status st = e.postXfer(nixl::WRITE, ll, rl, "selftest", h, &opt);
        for (int spins = 0; st == nixl::IN_PROG && spins < 1000000; spins++) st = e.checkXfer(h);
        CHECK(st == nixl::SUCCESS);
        for (size_t i = 0; i < BLOCKS; i++)
            CHECK(std::memcmp(&dst[(BLOCKS - 1 - i) * B], &src[i * B], B) == 0);
        std::fill(dst.begin(), dst.end(), 0);
    }
    CHECK(e.releaseReqH(h) == nixl::SUCCESS);

    // The transfers' notifications and one on its own, with our name.
    CHECK(e.genNotif("selftest", "alone") == nixl::SUCCESS);
    CHECK(e.genNotif("nobody", "x") == nixl::ERR_NOT_FOUND);
    nixl::NotifList got;
    for (int spins = 0; got.size() < 3 && spins < 100000; spins++) CHECK(e.getNotifs(got) == nixl::SUCCESS);
    CHECK(got.size() == 3);
    for (const auto &n : got) CHECK(n.first == "selftest");
    size_t done = 0, alone = 0;  // sent on transfer end: no order against genNotif
    for (const auto &n : got) {
        if (n.second == "done") done++;
        if (n.second == "alone") alone++;
    }
    CHECK(done == 2 && alone == 1);

    CHECK(e.unloadMD(rdst) == nixl::SUCCESS);
    CHECK(e.deregisterMem(smd) == nixl::SUCCESS);
    CHECK(e.deregisterMem(dmd) == nixl::SUCCESS);
    CHECK(e.disconnect("selftest") == nixl::SUCCESS);
    return 0;
#undef CHECK
}

}  // extern "C"

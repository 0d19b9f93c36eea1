/*
 * Test build of the Sunrise Tang runtime (libtangrt_shared.so) over host memory.
 *
 * CUDA-like signatures as Mooncake's Sunrise transport calls them. "Device"
 * memory is a memfd mapping, so an IPC handle (pid + fd) opens in another
 * process through /proc/<pid>/fd, like real device IPC. The node layout and
 * error injection come from the environment (see fake_sunrise.h).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fake_sunrise.h"

typedef enum {
    tangSuccess = 0,
    tangErrorInvalidValue = 1,
    tangErrorMemoryAllocation = 2,
    tangErrorInitializationError = 3,
    tangErrorInvalidDevicePointer = 17,
    tangErrorInvalidMemcpyDirection = 21,
    tangErrorNoDevice = 100,
    tangErrorInvalidDevice = 101,
    tangErrorPeerAccessUnsupported = 217,
    tangErrorUnknown = 999,
} tangError_t;

typedef enum {
    tangMemcpyHostToHost = 0,
    tangMemcpyHostToDevice = 1,
    tangMemcpyDeviceToHost = 2,
    tangMemcpyDeviceToDevice = 3,
    tangMemcpyDefault = 4,
} tangMemcpyKind;

typedef enum {
    tangMemoryTypeUnregistered = 0,
    tangMemoryTypeHost = 1,
    tangMemoryTypeDevice = 2,
} tangMemoryType;

typedef struct {
    tangMemoryType type;
    int device;
    void *devicePointer;
    void *hostPointer;
} tangPointerAttributes;

#define TANG_IPC_HANDLE_SIZE 64
typedef struct {
    char reserved[TANG_IPC_HANDLE_SIZE];
} tangIpcMemHandle_t;

typedef struct {
    uint32_t magic;
    int32_t pid;
    int32_t fd;
    int32_t device;
    uint64_t size;
    uint64_t offset;
} ipc_payload;

#define IPC_MAGIC 0x474e4154u /* "TANG" */
#define MAX_ALLOCS 4096

typedef struct {
    char *base;
    size_t size;
    int device;
    int fd;
    int imported;
} alloc_t;

static pthread_mutex_t alloc_lock = PTHREAD_MUTEX_INITIALIZER;
static alloc_t allocs[MAX_ALLOCS];
static __thread int current_device;

/* Host ranges page-locked with tangHostRegister, and what the copies saw: a test asserts that a device
 * buffer moved straight into registered (pinned) memory, never through a pageable intermediate. */
#define MAX_HOST_REGS 256
typedef struct {
    char *base;
    size_t size;
} host_reg_t;
static host_reg_t host_regs[MAX_HOST_REGS];
static unsigned long long n_registrations, n_pinned_copies, n_pageable_copies, n_pinned_bytes, n_pageable_bytes;

#define INJECT(name)                      \
    do {                                  \
        int injected_ = fake_fail(name);  \
        if (injected_) return injected_;  \
    } while (0)

/* The allocation holding [p, p+n), copied out; returns 0 when found. */
static int find_alloc(const void *p, size_t n, alloc_t *out) {
    int i, rc = -1;
    const char *c = p;
    pthread_mutex_lock(&alloc_lock);
    for (i = 0; i < MAX_ALLOCS; i++) {
        alloc_t *a = &allocs[i];
        if (a->base && c >= a->base && c + n <= a->base + a->size) {
            if (out) *out = *a;
            rc = 0;
            break;
        }
    }
    pthread_mutex_unlock(&alloc_lock);
    return rc;
}

static int add_alloc(alloc_t a) {
    int i;
    pthread_mutex_lock(&alloc_lock);
    for (i = 0; i < MAX_ALLOCS; i++) {
        if (!allocs[i].base) {
            allocs[i] = a;
            pthread_mutex_unlock(&alloc_lock);
            return 0;
        }
    }
    pthread_mutex_unlock(&alloc_lock);
    return -1;
}

static size_t used_bytes(int device) {
    size_t used = 0;
    int i;
    pthread_mutex_lock(&alloc_lock);
    for (i = 0; i < MAX_ALLOCS; i++)
        if (allocs[i].base && !allocs[i].imported && allocs[i].device == device) used += allocs[i].size;
    pthread_mutex_unlock(&alloc_lock);
    return used;
}

const char *tangGetErrorString(tangError_t err) {
    switch (err) {
    case tangSuccess: return "no error";
    case tangErrorInvalidValue: return "invalid argument";
    case tangErrorMemoryAllocation: return "out of memory";
    case tangErrorInitializationError: return "initialization error";
    case tangErrorInvalidDevicePointer: return "invalid device pointer";
    case tangErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case tangErrorNoDevice: return "no Sunrise-capable device is detected";
    case tangErrorInvalidDevice: return "invalid device ordinal";
    case tangErrorPeerAccessUnsupported: return "peer access is not supported between these two devices";
    default: return "unknown error";
    }
}

tangError_t tangGetDeviceCount(int *count) {
    fake_config_t cfg;
    INJECT("tangGetDeviceCount");
    if (!count) return tangErrorInvalidValue;
    fake_config(&cfg);
    if (!cfg.present) {
        *count = 0;
        return tangErrorNoDevice;
    }
    *count = cfg.ndev;
    return tangSuccess;
}

tangError_t tangSetDevice(int device) {
    fake_config_t cfg;
    INJECT("tangSetDevice");
    fake_config(&cfg);
    if (device < 0 || device >= cfg.ndev) return tangErrorInvalidDevice;
    current_device = device;
    return tangSuccess;
}

tangError_t tangGetDevice(int *device) {
    INJECT("tangGetDevice");
    if (!device) return tangErrorInvalidValue;
    *device = current_device;
    return tangSuccess;
}

tangError_t tangDeviceGetPCIBusId(char *bus_id, int len, int device) {
    fake_config_t cfg;
    INJECT("tangDeviceGetPCIBusId");
    fake_config(&cfg);
    if (device < 0 || device >= cfg.ndev) return tangErrorInvalidDevice;
    if (!bus_id || len <= 0) return tangErrorInvalidValue;
    snprintf(bus_id, (size_t)len, "%s", cfg.dev[device].bus_id);
    return tangSuccess;
}

tangError_t tangMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    fake_config_t cfg;
    size_t total, used;
    INJECT("tangMemGetInfo");
    fake_config(&cfg);
    if (current_device >= cfg.ndev) return tangErrorInvalidDevice;
    total = (size_t)cfg.dev[current_device].memory_bytes;
    used = used_bytes(current_device);
    if (free_bytes) *free_bytes = total > used ? total - used : 0;
    if (total_bytes) *total_bytes = total;
    return tangSuccess;
}

tangError_t tangMalloc(void **ptr, size_t size) {
    fake_config_t cfg;
    alloc_t a;
    int dev = current_device;
    INJECT("tangMalloc");
    fake_config(&cfg);
    if (!ptr || size == 0) return tangErrorInvalidValue;
    if (dev >= cfg.ndev) return tangErrorInvalidDevice;
    if (used_bytes(dev) + size > cfg.dev[dev].memory_bytes) return tangErrorMemoryAllocation;
    a.fd = memfd_create("tang-device-memory", MFD_CLOEXEC);
    if (a.fd < 0) return tangErrorMemoryAllocation;
    if (ftruncate(a.fd, (off_t)size) != 0) {
        close(a.fd);
        return tangErrorMemoryAllocation;
    }
    a.base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, a.fd, 0);
    if (a.base == MAP_FAILED) {
        close(a.fd);
        return tangErrorMemoryAllocation;
    }
    a.size = size;
    a.device = dev;
    a.imported = 0;
    if (add_alloc(a) != 0) {
        munmap(a.base, size);
        close(a.fd);
        return tangErrorMemoryAllocation;
    }
    *ptr = a.base;
    return tangSuccess;
}

static tangError_t release(void *ptr, int imported) {
    int i;
    pthread_mutex_lock(&alloc_lock);
    for (i = 0; i < MAX_ALLOCS; i++) {
        alloc_t *a = &allocs[i];
        if (a->base == ptr && a->imported == imported) {
            munmap(a->base, a->size);
            if (a->fd >= 0) close(a->fd);
            memset(a, 0, sizeof *a);
            pthread_mutex_unlock(&alloc_lock);
            return tangSuccess;
        }
    }
    pthread_mutex_unlock(&alloc_lock);
    return tangErrorInvalidDevicePointer;
}

tangError_t tangFree(void *ptr) {
    INJECT("tangFree");
    if (!ptr) return tangSuccess;
    return release(ptr, 0);
}

tangError_t tangPointerGetAttributes(tangPointerAttributes *attr, const void *ptr) {
    alloc_t a;
    INJECT("tangPointerGetAttributes");
    if (!attr) return tangErrorInvalidValue;
    memset(attr, 0, sizeof *attr);
    if (find_alloc(ptr, 1, &a) == 0) {
        attr->type = tangMemoryTypeDevice;
        attr->device = a.device;
        attr->devicePointer = (void *)ptr;
    } else {
        attr->type = tangMemoryTypeUnregistered;
        attr->device = -1;
        attr->hostPointer = (void *)ptr;
    }
    return tangSuccess;
}

/* Registered host memory holding [p, p+n)?  Caller holds alloc_lock. */
static int host_registered(const void *p, size_t n) {
    int i;
    const char *c = p;
    for (i = 0; i < MAX_HOST_REGS; i++)
        if (host_regs[i].base && c >= host_regs[i].base && c + n <= host_regs[i].base + host_regs[i].size) return 1;
    return 0;
}

#define tangErrorHostMemoryAlreadyRegistered 712
#define tangErrorHostMemoryNotRegistered 713

tangError_t tangHostRegister(void *ptr, size_t size, unsigned int flags) {
    int i, slot = -1;
    char *c = ptr;
    (void)flags;
    INJECT("tangHostRegister");
    if (!ptr || size == 0) return tangErrorInvalidValue;
    if (find_alloc(ptr, 1, NULL) == 0) return tangErrorInvalidValue; /* device memory is not host memory */
    pthread_mutex_lock(&alloc_lock);
    for (i = 0; i < MAX_HOST_REGS; i++) {
        host_reg_t *r = &host_regs[i];
        if (r->base && c < r->base + r->size && r->base < c + size) { /* overlaps: CUDA's error 712 */
            pthread_mutex_unlock(&alloc_lock);
            return tangErrorHostMemoryAlreadyRegistered;
        }
        if (!r->base && slot < 0) slot = i;
    }
    if (slot < 0) {
        pthread_mutex_unlock(&alloc_lock);
        return tangErrorMemoryAllocation;
    }
    host_regs[slot].base = c;
    host_regs[slot].size = size;
    n_registrations++;
    pthread_mutex_unlock(&alloc_lock);
    return tangSuccess;
}

tangError_t tangHostUnregister(void *ptr) {
    int i;
    INJECT("tangHostUnregister");
    pthread_mutex_lock(&alloc_lock);
    for (i = 0; i < MAX_HOST_REGS; i++) {
        if (host_regs[i].base == ptr) {
            host_regs[i].base = NULL;
            host_regs[i].size = 0;
            pthread_mutex_unlock(&alloc_lock);
            return tangSuccess;
        }
    }
    pthread_mutex_unlock(&alloc_lock);
    return tangErrorHostMemoryNotRegistered;
}

/* Test hook (not a Tang API): registrations made, H2D/D2H copies whose host side was registered or pageable,
 * and their bytes. */
void fakeTangCounters(unsigned long long out[5]) {
    pthread_mutex_lock(&alloc_lock);
    out[0] = n_registrations;
    out[1] = n_pinned_copies;
    out[2] = n_pageable_copies;
    out[3] = n_pinned_bytes;
    out[4] = n_pageable_bytes;
    pthread_mutex_unlock(&alloc_lock);
}

static void count_host_copy(const void *host, size_t n) {
    pthread_mutex_lock(&alloc_lock);
    if (host_registered(host, n)) {
        n_pinned_copies++;
        n_pinned_bytes += n;
    } else {
        n_pageable_copies++;
        n_pageable_bytes += n;
    }
    pthread_mutex_unlock(&alloc_lock);
}

tangError_t tangMemcpy(void *dst, const void *src, size_t count, tangMemcpyKind kind) {
    int dst_dev = find_alloc(dst, count, NULL) == 0;
    int src_dev = find_alloc(src, count, NULL) == 0;
    INJECT("tangMemcpy");
    if (count == 0) return tangSuccess;
    if (!dst || !src) return tangErrorInvalidValue;
    switch (kind) {
    case tangMemcpyHostToDevice:
        if (!dst_dev || src_dev) return tangErrorInvalidMemcpyDirection;
        break;
    case tangMemcpyDeviceToHost:
        if (!src_dev || dst_dev) return tangErrorInvalidMemcpyDirection;
        break;
    case tangMemcpyDeviceToDevice:
        if (!src_dev || !dst_dev) return tangErrorInvalidMemcpyDirection;
        break;
    case tangMemcpyHostToHost:
    case tangMemcpyDefault:
        break;
    default:
        return tangErrorInvalidMemcpyDirection;
    }
    if (kind == tangMemcpyHostToDevice) count_host_copy(src, count);
    if (kind == tangMemcpyDeviceToHost) count_host_copy(dst, count);
    memmove(dst, src, count);
    return tangSuccess;
}

tangError_t tangMemcpyPeer(void *dst, int dst_device, const void *src, int src_device, size_t count) {
    alloc_t d, s;
    fake_config_t cfg;
    INJECT("tangMemcpyPeer");
    fake_config(&cfg);
    if (dst_device < 0 || dst_device >= cfg.ndev || src_device < 0 || src_device >= cfg.ndev)
        return tangErrorInvalidDevice;
    if (find_alloc(dst, count, &d) != 0 || find_alloc(src, count, &s) != 0) return tangErrorInvalidValue;
    if (d.device != dst_device || s.device != src_device) return tangErrorInvalidValue;
    memmove(dst, src, count);
    return tangSuccess;
}

/* Maps peer memory through a Sunrise Link port: only where that port is linked to the owner. */
tangError_t tangDeviceGetPeerPointer(int device, int port, void *peer_ptr, void **mapped) {
    alloc_t owner;
    fake_config_t cfg;
    int i;
    INJECT("tangDeviceGetPeerPointer");
    fake_config(&cfg);
    if (device < 0 || device >= cfg.ndev) return tangErrorInvalidDevice;
    if (!mapped || find_alloc(peer_ptr, 1, &owner) != 0) return tangErrorInvalidValue;
    for (i = 0; i < cfg.nlink; i++) {
        fake_link *l = &cfg.link[i];
        if (!l->up) continue;
        if ((l->local_chip == device && l->local_port == port && l->remote_chip == owner.device) ||
            (l->remote_chip == device && l->remote_port == port && l->local_chip == owner.device)) {
            *mapped = peer_ptr;
            return tangSuccess;
        }
    }
    return tangErrorPeerAccessUnsupported;
}

tangError_t tangIpcGetMemHandle(tangIpcMemHandle_t *handle, void *ptr) {
    alloc_t a;
    ipc_payload p;
    INJECT("tangIpcGetMemHandle");
    if (!handle || find_alloc(ptr, 1, &a) != 0 || a.imported) return tangErrorInvalidValue;
    memset(handle, 0, sizeof *handle);
    p.magic = IPC_MAGIC;
    p.pid = (int32_t)getpid();
    p.fd = a.fd;
    p.device = a.device;
    p.size = a.size;
    p.offset = (uint64_t)((char *)ptr - a.base);
    memcpy(handle->reserved, &p, sizeof p);
    return tangSuccess;
}

tangError_t tangIpcOpenMemHandle(void **ptr, tangIpcMemHandle_t handle, unsigned int flags) {
    ipc_payload p;
    char path[64];
    alloc_t a;
    (void)flags;
    INJECT("tangIpcOpenMemHandle");
    memcpy(&p, handle.reserved, sizeof p);
    if (!ptr || p.magic != IPC_MAGIC) return tangErrorInvalidValue;
    snprintf(path, sizeof path, "/proc/%d/fd/%d", p.pid, p.fd);
    a.fd = open(path, O_RDWR | O_CLOEXEC);
    if (a.fd < 0) return tangErrorInvalidValue;
    a.base = mmap(NULL, (size_t)p.size, PROT_READ | PROT_WRITE, MAP_SHARED, a.fd, 0);
    if (a.base == MAP_FAILED) {
        close(a.fd);
        return tangErrorMemoryAllocation;
    }
    a.size = (size_t)p.size;
    a.device = p.device;
    a.imported = 1;
    if (add_alloc(a) != 0) {
        munmap(a.base, a.size);
        close(a.fd);
        return tangErrorMemoryAllocation;
    }
    *ptr = a.base + p.offset;
    return tangSuccess;
}

tangError_t tangIpcCloseMemHandle(void *ptr) {
    alloc_t a;
    INJECT("tangIpcCloseMemHandle");
    if (find_alloc(ptr, 1, &a) != 0 || !a.imported) return tangErrorInvalidValue;
    return release(a.base, 1);
}

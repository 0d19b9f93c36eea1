/*
 * Test build of the Sunrise management library (libptml_shared.so).
 *
 * Device count, memory, brand, PCI info and the Sunrise Link physical
 * topology (ptmlPtlinkPhytopoDetect) from the fake node description in
 * DAYBREAK_FAKE_SUNRISE; error injection via DAYBREAK_FAKE_SUNRISE_FAIL
 * (see fake_sunrise.h). Struct layouts follow the public ptml.h.
 */
#include <stdint.h>

#include "fake_sunrise.h"

typedef enum {
    PTML_SUCCESS = 0,
    PTML_ERROR_UNINITIALIZED,
    PTML_ERROR_INVALID_ARGUMENT,
    PTML_ERROR_ALREADY_INITIALIZED,
    PTML_ERROR_INSUFFICIENT_SIZE,
    PTML_ERROR_IN_USE,
    PTML_ERROR_DRIVER_NOT_LOADED,
    PTML_ERROR_DEVICE_NOT_FOUND,
    PTML_ERROR_EVENT_TIMEOUT,
    PTML_ERROR_UNKNOWN,
} ptmlReturn_t;

typedef int ptmlDevice_t;

typedef struct {
    size_t total;
    size_t used;
    size_t free;
} ptMemory_t;

typedef struct {
    int domain;
    int bus;
    int device;
    int vendor;
    int pciSubSystemId;
    char busId[32];
    unsigned int max_link_speed;
    unsigned int max_link_width;
    unsigned int max_bandwidth;
    unsigned int curr_link_speed;
    unsigned int curr_link_width;
    unsigned int curr_bandwidth;
} ptPciInfo_t;

typedef struct {
    unsigned char local_chipid;
    unsigned char local_port;
    unsigned char remote_chipid;
    unsigned char remote_port;
    unsigned char link_status;
    unsigned char isBif;
    unsigned char max_speed;
    unsigned char cur_speed;
    unsigned char max_bandwidth;
    unsigned char cur_bandwidth;
} ptPhyTopo_t;

static int initialized;

#define INJECT(name)                      \
    do {                                  \
        int injected_ = fake_fail(name);  \
        if (injected_) return (ptmlReturn_t)injected_; \
    } while (0)

#define NEED_DEVICE(cfg, dev)                                   \
    do {                                                        \
        if (!initialized) return PTML_ERROR_UNINITIALIZED;      \
        fake_config(&(cfg));                                    \
        if ((dev) < 0 || (dev) >= (cfg).ndev) return PTML_ERROR_DEVICE_NOT_FOUND; \
    } while (0)

const char *ptmlGetErrorCodeToDescription(int code) {
    switch (code) {
    case PTML_SUCCESS: return "success";
    case PTML_ERROR_UNINITIALIZED: return "ptmlInit was not called";
    case PTML_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case PTML_ERROR_ALREADY_INITIALIZED: return "already initialized";
    case PTML_ERROR_INSUFFICIENT_SIZE: return "buffer too small";
    case PTML_ERROR_IN_USE: return "device in use";
    case PTML_ERROR_DRIVER_NOT_LOADED: return "driver is not loaded";
    case PTML_ERROR_DEVICE_NOT_FOUND: return "device not found";
    case PTML_ERROR_EVENT_TIMEOUT: return "event timeout";
    default: return "unknown error";
    }
}

ptmlReturn_t ptmlInit(void) {
    fake_config_t cfg;
    INJECT("ptmlInit");
    fake_config(&cfg);
    if (!cfg.present) return PTML_ERROR_DRIVER_NOT_LOADED;
    initialized = 1;
    return PTML_SUCCESS;
}

void ptmlUninit(void) { initialized = 0; }

ptmlReturn_t ptmlDeviceGetCount(int *count) {
    fake_config_t cfg;
    INJECT("ptmlDeviceGetCount");
    if (!initialized) return PTML_ERROR_UNINITIALIZED;
    if (!count) return PTML_ERROR_INVALID_ARGUMENT;
    fake_config(&cfg);
    *count = cfg.ndev;
    return PTML_SUCCESS;
}

ptmlReturn_t ptmlPtlinkEnableAll(void) {
    INJECT("ptmlPtlinkEnableAll");
    return initialized ? PTML_SUCCESS : PTML_ERROR_UNINITIALIZED;
}

ptmlReturn_t ptmlDeviceGetMemoryInfo(ptmlDevice_t device, ptMemory_t *mem) {
    fake_config_t cfg;
    INJECT("ptmlDeviceGetMemoryInfo");
    NEED_DEVICE(cfg, device);
    if (!mem) return PTML_ERROR_INVALID_ARGUMENT;
    mem->total = (size_t)cfg.dev[device].memory_bytes;
    mem->used = 0;
    mem->free = mem->total;
    return PTML_SUCCESS;
}

/* The public header has no length: callers pass a generous buffer. */
ptmlReturn_t ptmlDeviceGetBrand(ptmlDevice_t device, char *brand) {
    fake_config_t cfg;
    INJECT("ptmlDeviceGetBrand");
    NEED_DEVICE(cfg, device);
    if (!brand) return PTML_ERROR_INVALID_ARGUMENT;
    snprintf(brand, 64, "%s", cfg.dev[device].name);
    return PTML_SUCCESS;
}

ptmlReturn_t ptmlDeviceGetUUID(ptmlDevice_t device, char *uuid, unsigned int length) {
    fake_config_t cfg;
    INJECT("ptmlDeviceGetUUID");
    NEED_DEVICE(cfg, device);
    if (!uuid || length == 0) return PTML_ERROR_INVALID_ARGUMENT;
    snprintf(uuid, length, "%s", cfg.dev[device].uuid);
    return PTML_SUCCESS;
}

ptmlReturn_t ptmlDeviceGetPciInfo(ptmlDevice_t device, ptPciInfo_t *info) {
    fake_config_t cfg;
    unsigned int domain = 0, bus = 0, dev = 0, fn = 0;
    INJECT("ptmlDeviceGetPciInfo");
    NEED_DEVICE(cfg, device);
    if (!info) return PTML_ERROR_INVALID_ARGUMENT;
    memset(info, 0, sizeof *info);
    sscanf(cfg.dev[device].bus_id, "%x:%x:%x.%x", &domain, &bus, &dev, &fn);
    info->domain = (int)domain;
    info->bus = (int)bus;
    info->device = (int)((dev << 3) | fn);
    snprintf(info->busId, sizeof info->busId, "%s", cfg.dev[device].bus_id);
    return PTML_SUCCESS;
}

/* One entry per port of `device` that has a link, at the index of its local port. */
ptmlReturn_t ptmlPtlinkPhytopoDetect(ptmlDevice_t device, uint32_t size, void *buffer) {
    fake_config_t cfg;
    ptPhyTopo_t *out = buffer;
    uint32_t slots = size / (uint32_t)sizeof(ptPhyTopo_t);
    int i;
    INJECT("ptmlPtlinkPhytopoDetect");
    NEED_DEVICE(cfg, device);
    if (!buffer) return PTML_ERROR_INVALID_ARGUMENT;
    memset(buffer, 0, size);
    for (i = 0; i < cfg.nlink; i++) {
        fake_link *l = &cfg.link[i];
        int lc, lp, rc, rp;
        if (l->local_chip == device) {
            lc = l->local_chip; lp = l->local_port; rc = l->remote_chip; rp = l->remote_port;
        } else if (l->remote_chip == device) {
            lc = l->remote_chip; lp = l->remote_port; rc = l->local_chip; rp = l->local_port;
        } else {
            continue;
        }
        if (lp < 0 || (uint32_t)lp >= slots) return PTML_ERROR_INSUFFICIENT_SIZE;
        out[lp].local_chipid = (unsigned char)lc;
        out[lp].local_port = (unsigned char)lp;
        out[lp].remote_chipid = (unsigned char)rc;
        out[lp].remote_port = (unsigned char)rp;
        out[lp].link_status = (unsigned char)(l->up ? 1 : 0);
        out[lp].max_speed = 32;
        out[lp].cur_speed = (unsigned char)(l->up ? 32 : 0);
    }
    return PTML_SUCCESS;
}

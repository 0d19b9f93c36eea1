/*
 * Shared by the test builds of libtangrt_shared.so and libptml_shared.so:
 * the fake node description and the error injection, both from the environment.
 *
 *   DAYBREAK_FAKE_SUNRISE       inline JSON, or the path of a JSON file:
 *     {"devices": [{"bus_id": "0000:03:00.0", "memory_bytes": 1073741824,
 *                   "name": "Sunrise S2", "uuid": "SR-0"}, ...],
 *      "links": [[local_chip, local_port, remote_chip, remote_port], ...]}
 *     A link may carry a fifth element 0 to mark it down. Unset means "no driver":
 *     ptmlInit returns PTML_ERROR_DRIVER_NOT_LOADED and tangGetDeviceCount tangErrorNoDevice.
 *   DAYBREAK_FAKE_SUNRISE_FAIL  "fnName=code,fnName=code": that function returns the code.
 *
 * The description is re-read whenever the variable's value changes, so one
 * process can load the library once and run several scenarios.
 */
#ifndef DAYBREAK_FAKE_SUNRISE_H
#define DAYBREAK_FAKE_SUNRISE_H

#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FAKE_MAX_DEVICES 64
#define FAKE_MAX_LINKS 512

typedef struct {
    char bus_id[32];
    unsigned long long memory_bytes;
    char name[64];
    char uuid[64];
} fake_device;

typedef struct {
    int local_chip, local_port, remote_chip, remote_port, up;
} fake_link;

typedef struct {
    int present; /* DAYBREAK_FAKE_SUNRISE set and parsed */
    int ndev;
    fake_device dev[FAKE_MAX_DEVICES];
    int nlink;
    fake_link link[FAKE_MAX_LINKS];
} fake_config_t;

static pthread_mutex_t fake_cfg_lock = PTHREAD_MUTEX_INITIALIZER;
static fake_config_t fake_cfg;
static char *fake_cfg_source; /* the env value the config was parsed from */

/* ---- a small JSON reader: enough for the schema above ------------------ */
typedef struct {
    const char *p;
    int error;
} jreader;

static void j_ws(jreader *r) {
    while (*r->p && isspace((unsigned char)*r->p)) r->p++;
}

static int j_expect(jreader *r, char c) {
    j_ws(r);
    if (*r->p != c) {
        r->error = 1;
        return 0;
    }
    r->p++;
    return 1;
}

static void j_string(jreader *r, char *out, size_t cap) {
    size_t n = 0;
    if (!j_expect(r, '"')) return;
    while (*r->p && *r->p != '"') {
        char c = *r->p++;
        if (c == '\\' && *r->p) c = *r->p++;
        if (out && n + 1 < cap) out[n++] = c;
    }
    if (*r->p != '"') {
        r->error = 1;
        return;
    }
    r->p++;
    if (out) out[n] = 0;
}

static double j_number(jreader *r) {
    char *end = NULL;
    double v;
    j_ws(r);
    v = strtod(r->p, &end);
    if (end == r->p) r->error = 1;
    r->p = end;
    return v;
}

static void j_skip(jreader *r) {
    j_ws(r);
    if (*r->p == '"') {
        j_string(r, NULL, 0);
    } else if (*r->p == '{' || *r->p == '[') {
        char close = *r->p == '{' ? '}' : ']';
        r->p++;
        j_ws(r);
        if (*r->p == close) {
            r->p++;
            return;
        }
        for (;;) {
            if (close == '}') {
                j_string(r, NULL, 0);
                j_expect(r, ':');
            }
            j_skip(r);
            j_ws(r);
            if (r->error) return;
            if (*r->p == ',') {
                r->p++;
                continue;
            }
            j_expect(r, close);
            return;
        }
    } else if (!strncmp(r->p, "true", 4)) {
        r->p += 4;
    } else if (!strncmp(r->p, "false", 5)) {
        r->p += 5;
    } else if (!strncmp(r->p, "null", 4)) {
        r->p += 4;
    } else {
        j_number(r);
    }
}

/* Calls item(r, ctx) for each element of an array. */
static void j_array(jreader *r, void (*item)(jreader *, void *), void *ctx) {
    if (!j_expect(r, '[')) return;
    j_ws(r);
    if (*r->p == ']') {
        r->p++;
        return;
    }
    for (;;) {
        item(r, ctx);
        if (r->error) return;
        j_ws(r);
        if (*r->p == ',') {
            r->p++;
            continue;
        }
        j_expect(r, ']');
        return;
    }
}

static void j_device(jreader *r, void *ctx) {
    fake_config_t *cfg = ctx;
    fake_device d;
    char key[64];
    memset(&d, 0, sizeof d);
    snprintf(d.name, sizeof d.name, "Sunrise S2");
    if (!j_expect(r, '{')) return;
    j_ws(r);
    if (*r->p == '}') {
        r->p++;
    } else {
        for (;;) {
            j_string(r, key, sizeof key);
            j_expect(r, ':');
            if (r->error) return;
            if (!strcmp(key, "bus_id")) j_string(r, d.bus_id, sizeof d.bus_id);
            else if (!strcmp(key, "memory_bytes")) d.memory_bytes = (unsigned long long)j_number(r);
            else if (!strcmp(key, "name")) j_string(r, d.name, sizeof d.name);
            else if (!strcmp(key, "uuid")) j_string(r, d.uuid, sizeof d.uuid);
            else j_skip(r);
            j_ws(r);
            if (r->error) return;
            if (*r->p == ',') {
                r->p++;
                continue;
            }
            j_expect(r, '}');
            break;
        }
    }
    if (cfg->ndev < FAKE_MAX_DEVICES) cfg->dev[cfg->ndev++] = d;
}

typedef struct {
    int v[5];
    int n;
} j_ints;

static void j_int_item(jreader *r, void *ctx) {
    j_ints *ints = ctx;
    double v = j_number(r);
    if (ints->n < 5) ints->v[ints->n] = (int)v;
    ints->n++;
}

static void j_link(jreader *r, void *ctx) {
    fake_config_t *cfg = ctx;
    j_ints ints = {{0, 0, 0, 0, 1}, 0};
    j_array(r, j_int_item, &ints);
    if (r->error) return;
    if (ints.n < 4) {
        r->error = 1;
        return;
    }
    if (cfg->nlink < FAKE_MAX_LINKS) {
        fake_link *l = &cfg->link[cfg->nlink++];
        l->local_chip = ints.v[0];
        l->local_port = ints.v[1];
        l->remote_chip = ints.v[2];
        l->remote_port = ints.v[3];
        l->up = ints.n >= 5 ? ints.v[4] != 0 : 1;
    }
}

static int fake_parse(const char *text, fake_config_t *cfg) {
    jreader r = {text, 0};
    char key[64];
    memset(cfg, 0, sizeof *cfg);
    if (!j_expect(&r, '{')) return -1;
    j_ws(&r);
    if (*r.p == '}') return 0;
    for (;;) {
        j_string(&r, key, sizeof key);
        j_expect(&r, ':');
        if (r.error) return -1;
        if (!strcmp(key, "devices")) j_array(&r, j_device, cfg);
        else if (!strcmp(key, "links")) j_array(&r, j_link, cfg);
        else j_skip(&r);
        j_ws(&r);
        if (r.error) return -1;
        if (*r.p == ',') {
            r.p++;
            continue;
        }
        return j_expect(&r, '}') ? 0 : -1;
    }
}

static char *fake_read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    long n;
    char *buf;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    if (buf) buf[n] = 0;
    fclose(f);
    return buf;
}

/* A snapshot of the current description (copied under the lock). */
static void fake_config(fake_config_t *out) {
    const char *env = getenv("DAYBREAK_FAKE_SUNRISE");
    pthread_mutex_lock(&fake_cfg_lock);
    if (!env || !*env) {
        memset(&fake_cfg, 0, sizeof fake_cfg);
        free(fake_cfg_source);
        fake_cfg_source = NULL;
    } else if (!fake_cfg_source || strcmp(fake_cfg_source, env)) {
        const char *s = env;
        char *file = NULL;
        while (*s && isspace((unsigned char)*s)) s++;
        if (*s != '{') file = fake_read_file(env);
        if (fake_parse(file ? file : s, &fake_cfg) == 0) {
            fake_cfg.present = 1;
        } else {
            fprintf(stderr, "fake sunrise: cannot parse DAYBREAK_FAKE_SUNRISE\n");
            memset(&fake_cfg, 0, sizeof fake_cfg);
        }
        free(file);
        free(fake_cfg_source);
        fake_cfg_source = strdup(env);
    }
    *out = fake_cfg;
    pthread_mutex_unlock(&fake_cfg_lock);
}

/* The injected return code for `fn`, or 0. */
static int fake_fail(const char *fn) {
    const char *env = getenv("DAYBREAK_FAKE_SUNRISE_FAIL");
    size_t n = strlen(fn);
    if (!env) return 0;
    while (*env) {
        while (*env == ',' || isspace((unsigned char)*env)) env++;
        if (!strncmp(env, fn, n) && env[n] == '=') return atoi(env + n + 1);
        while (*env && *env != ',') env++;
    }
    return 0;
}

#endif

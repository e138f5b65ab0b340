/*
 * wire_check.c - the client's raw request bytes, framed strictly (see
 * wire_check.h).
 */
#define _GNU_SOURCE
/* This file defines recv(): no fortified inline wrapper of it. */
#undef _FORTIFY_SOURCE
#include "wire_check.h"

#include "policy.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

/* How much of a line is kept: its field name, when it is one of those that
 * frame the body (whose values are read as they come, white space and
 * leading zeros of any length included). */
#define LINE_KEEP 32
/* The longest Content-Length: 18 digits without the leading zeros. */
#define CL_DIGITS 18

enum wstate {
    W_LEAD,      /* before a request line: empty lines (CRLF) are skipped */
    W_HEAD,      /* the request line and the field lines */
    W_CL,        /* a Content-Length body */
    W_CSIZE,     /* a chunk-size line */
    W_CDATA,     /* chunk data */
    W_CDATA_END, /* the CRLF after chunk data */
    W_TRAILER,   /* after the last chunk: only the empty line */
    W_BAD        /* a rule broken: nothing after it is framed */
};

struct wire_req {
    uint64_t body_len;
    bool bad;
};

struct wire_check {
    int fd;
    enum wstate st;
    bool cr; /* the byte before was a CR: an LF must follow */
    /* the current line */
    bool first_line;
    bool colon;              /* a ':' seen in this field line */
    size_t name_len;         /* bytes before the first ':' */
    char before_colon;       /* the byte before it */
    size_t line_len;         /* bytes so far, without the line end */
    char line[LINE_KEEP];    /* the first LINE_KEEP of them */
    /* the value of a Content-Length or Transfer-Encoding line, as it comes */
    enum { V_NONE, V_CL, V_TE } vkind;
    int vstate;     /* 0 white space before it, 1 in it, 2 white space after */
    bool vbad;      /* white space inside, a byte that does not belong */
    unsigned vdigits, vsig; /* Content-Length: digits, those after the zeros */
    uint64_t vnum;
    char vte[8];    /* Transfer-Encoding: its first bytes */
    unsigned vlen;
    unsigned digits;         /* chunk-size line: hex digits read */
    int csize_phase;         /* 0 digits, 1 white space, 2 extension */
    /* the current request */
    bool head_done, seen_cl, chunked;
    uint64_t cl, body_len, remaining;
    /* requests framed and not yet done, oldest first: in qi, or beyond a
     * few (many pipelined at once) on the heap */
    struct wire_req *q;
    size_t q_len, q_cap;
    struct wire_req qi[4];
    bool desync; /* the server finished a request this never framed */
    bool oom;    /* a request could not be counted: every one from here fails */
};

static _Atomic(struct wire_check *) *g_table;
static size_t g_table_len;
static ssize_t (*g_real_recv)(int, void *, size_t, int);

int wire_check_global_init(size_t max_fds)
{
    void *sym;

    if (g_table == NULL) {
        g_table = calloc(max_fds, sizeof(*g_table));
        if (g_table == NULL)
            return -1;
        g_table_len = max_fds;
    }
    sym = dlsym(RTLD_NEXT, "recv");
    if (sym != NULL)
        memcpy(&g_real_recv, &sym, sizeof(sym));
    return 0;
}

bool wire_check_interposed(void)
{
    void *sym = dlsym(RTLD_DEFAULT, "recv");
    ssize_t (*mine)(int, void *, size_t, int) = recv;
    void *mine_p;

    memcpy(&mine_p, &mine, sizeof(mine_p));
    return sym != NULL && sym == mine_p;
}

/* Every recv() of the process, libmicrohttpd's included, comes here first
 * (the executable's definition wins over libc's); bytes read from a
 * registered client connection go to its checker. */
ssize_t recv(int fd, void *buf, size_t len, int flags)
{
    ssize_t n = g_real_recv != NULL ? g_real_recv(fd, buf, len, flags)
                                    : (ssize_t)syscall(SYS_recvfrom, fd, buf, len, flags, NULL,
                                                       NULL);

    if (n > 0 && (flags & MSG_PEEK) == 0 && g_table != NULL && fd >= 0 &&
        (size_t)fd < g_table_len) {
        struct wire_check *wc = atomic_load_explicit(&g_table[fd], memory_order_acquire);
        if (wc != NULL)
            wire_check_feed(wc, buf, (size_t)n);
    }
    return n;
}

struct wire_check *wire_check_new(void)
{
    struct wire_check *wc = calloc(1, sizeof(*wc));

    if (wc != NULL) {
        wc->fd = -1;
        wc->q = wc->qi;
        wc->q_cap = sizeof(wc->qi) / sizeof(wc->qi[0]);
    }
    return wc;
}

void wire_check_free(struct wire_check *wc)
{
    if (wc == NULL)
        return;
    if (wc->q != wc->qi)
        free(wc->q);
    free(wc);
}

struct wire_check *wire_check_open(int fd)
{
    struct wire_check *wc;

    if (g_table == NULL || fd < 0 || (size_t)fd >= g_table_len)
        return NULL;
    wc = wire_check_new();
    if (wc == NULL)
        return NULL;
    wc->fd = fd;
    atomic_store_explicit(&g_table[fd], wc, memory_order_release);
    return wc;
}

void wire_check_close(struct wire_check *wc)
{
    if (wc == NULL)
        return;
    if (wc->fd >= 0 && (size_t)wc->fd < g_table_len)
        atomic_store_explicit(&g_table[wc->fd], NULL, memory_order_release);
    wire_check_free(wc);
}

/* ---- the framing ---------------------------------------------------------- */

static void push(struct wire_check *wc, bool bad)
{
    if (wc->q_len == wc->q_cap) {
        size_t cap = wc->q_cap * 2;
        struct wire_req *nq = wc->q == wc->qi ? malloc(cap * sizeof(*nq))
                                              : realloc(wc->q, cap * sizeof(*nq));
        if (nq == NULL) {
            /* Cannot keep count: every request from here fails. */
            wc->oom = true;
            wc->st = W_BAD;
            return;
        }
        if (wc->q == wc->qi)
            memcpy(nq, wc->qi, sizeof(wc->qi));
        wc->q = nq;
        wc->q_cap = cap;
    }
    wc->q[wc->q_len].body_len = wc->body_len;
    wc->q[wc->q_len].bad = bad;
    wc->q_len++;
}

static void fail(struct wire_check *wc)
{
    if (wc->st != W_BAD) {
        push(wc, true);
        wc->st = W_BAD;
    }
}

static void new_line(struct wire_check *wc)
{
    wc->line_len = 0;
    wc->colon = false;
    wc->name_len = 0;
    wc->before_colon = 0;
    wc->vkind = V_NONE;
    wc->vstate = 0;
    wc->vbad = false;
    wc->vdigits = wc->vsig = wc->vlen = 0;
    wc->vnum = 0;
    wc->digits = 0;
    wc->csize_phase = 0;
}

static void request_done(struct wire_check *wc)
{
    push(wc, false);
    if (wc->st == W_BAD)
        return;
    wc->st = W_LEAD;
    wc->head_done = wc->seen_cl = wc->chunked = false;
    wc->cl = wc->body_len = 0;
    new_line(wc);
}

static bool is_ows(char c)
{
    return c == ' ' || c == '\t';
}

/* A field line ended (its CRLF read). */
static void field_line(struct wire_check *wc)
{
    if (is_ows(wc->line[0]) || wc->line[0] == ':' || !wc->colon || is_ows(wc->before_colon)) {
        fail(wc);
        return;
    }
    if (wc->vkind == V_CL) {
        if (wc->vbad || wc->vdigits == 0 || wc->seen_cl) {
            fail(wc);
            return;
        }
        wc->seen_cl = true;
        wc->cl = wc->vnum;
    } else if (wc->vkind == V_TE) {
        /* White space after "chunked": libmicrohttpd 0.9.75 does not read
         * it as chunked and would wait for the connection's end. */
        if (wc->vbad || wc->chunked || wc->vstate == 2 || wc->vlen != 7 ||
            strncasecmp(wc->vte, "chunked", 7) != 0) {
            fail(wc);
            return;
        }
        wc->chunked = true;
    }
}

/* One byte of a field value (after the colon), not a line end. */
static void value_byte(struct wire_check *wc, char c)
{
    if (is_ows(c)) {
        if (wc->vstate == 1)
            wc->vstate = 2;
        return;
    }
    if (wc->vstate == 2)
        wc->vbad = true; /* white space inside: "1 2", "chunked x" */
    wc->vstate = 1;
    if (wc->vkind == V_CL) {
        if (c < '0' || c > '9') {
            wc->vbad = true;
            return;
        }
        wc->vdigits++;
        if (wc->vsig == 0 && c == '0')
            return;
        if (wc->vsig == CL_DIGITS) {
            wc->vbad = true;
            return;
        }
        wc->vnum = wc->vnum * 10 + (uint64_t)(c - '0');
        wc->vsig++;
    } else if (wc->vlen < sizeof(wc->vte)) {
        wc->vte[wc->vlen++] = c;
    } else {
        wc->vbad = true;
    }
}

/* A head line ended (its CRLF read). */
static void head_line(struct wire_check *wc)
{
    if (wc->first_line) {
        wc->first_line = false;
    } else if (wc->line_len > 0) {
        field_line(wc);
    } else {
        /* The empty line: the head is complete, the body's framing known. */
        wc->head_done = true;
        if (wc->chunked && wc->seen_cl) {
            fail(wc);
            return;
        }
        if (wc->chunked) {
            wc->st = W_CSIZE;
            wc->remaining = 0;
        } else if (wc->cl > 0) {
            wc->st = W_CL;
            wc->remaining = wc->cl;
        } else {
            request_done(wc);
            return;
        }
    }
    new_line(wc);
}

/* One byte of a chunk-size line, not a line end. */
static void csize_byte(struct wire_check *wc, char c)
{
    int h = idem_hex_value(c);

    switch (wc->csize_phase) {
    case 0:
        if (h >= 0) {
            /* Leading zeros are fine; a size past 2^60 holds no body. */
            if (wc->remaining >= (UINT64_C(1) << 56)) {
                fail(wc);
                return;
            }
            wc->remaining = wc->remaining * 16 + (uint64_t)h;
            wc->digits++;
            return;
        }
        if (wc->digits == 0) {
            fail(wc);
        } else if (c == ';') {
            wc->csize_phase = 2;
        } else if (is_ows(c)) {
            wc->csize_phase = 1;
        } else {
            fail(wc);
        }
        return;
    case 1:
        if (c == ';')
            wc->csize_phase = 2;
        else if (!is_ows(c))
            fail(wc);
        return;
    default:
        /* chunk-ext: no control byte but HT */
        if (((unsigned char)c < 0x20 && c != '\t') || c == 0x7f)
            fail(wc);
        return;
    }
}

static void csize_end(struct wire_check *wc)
{
    /* White space after the size only before an extension (BWS ";"). */
    if (wc->digits == 0 || wc->csize_phase == 1) {
        fail(wc);
        return;
    }
    if (wc->remaining == 0) {
        wc->st = W_TRAILER;
        return;
    }
    if (wc->body_len + wc->remaining < wc->body_len) {
        fail(wc);
        return;
    }
    wc->st = W_CDATA;
}

/* Bytes of a head line that only count and are kept: STOP_LINE ends every
 * run, STOP_NAME also a field name's. */
#define STOP_LINE 1
#define STOP_NAME 2
static const unsigned char g_stop[256] = {
    ['\0'] = STOP_LINE | STOP_NAME,
    ['\n'] = STOP_LINE | STOP_NAME,
    ['\r'] = STOP_LINE | STOP_NAME,
    [':'] = STOP_NAME,
};

/* Right after a byte of a head line (W_HEAD, no CR pending): the bytes from
 * i on that the byte-by-byte loop would only count and keep, taken in one
 * pass. Those are the rest of the request line, of a field name up to its
 * ':', and of a value that does not frame the body; a framing field's value
 * (Content-Length, Transfer-Encoding) is read byte by byte. Returns where
 * the loop goes on. Fed whole or a byte at a time, a stream ends in the
 * same state (tests/unit/test_wire_check.c, tests/fuzz/fuzz_wire.c). */
static size_t skip_plain(struct wire_check *wc, const char *buf, size_t i, size_t n)
{
    bool name = !wc->first_line && !wc->colon;
    unsigned char mask = name ? STOP_NAME : STOP_LINE;
    size_t j = i;
    size_t run;

    if (wc->colon && wc->vkind != V_NONE)
        return i;
    while (j < n && (g_stop[(unsigned char)buf[j]] & mask) == 0)
        j++;
    run = j - i;
    if (run == 0)
        return i;
    if (name)
        wc->before_colon = buf[j - 1];
    if (wc->line_len < LINE_KEEP) {
        size_t keep = LINE_KEEP - wc->line_len;
        memcpy(wc->line + wc->line_len, buf + i, keep < run ? keep : run);
    }
    wc->line_len = run > SIZE_MAX - wc->line_len ? SIZE_MAX : wc->line_len + run;
    return j;
}

void wire_check_feed(struct wire_check *wc, const char *buf, size_t n)
{
    size_t i = 0;

    while (i < n && wc->st != W_BAD) {
        char c = buf[i];

        switch (wc->st) {
        case W_CL:
        case W_CDATA: {
            size_t take = n - i;
            if ((uint64_t)take > wc->remaining)
                take = (size_t)wc->remaining;
            wc->remaining -= take;
            wc->body_len += take;
            i += take;
            if (wc->remaining == 0) {
                if (wc->st == W_CL) {
                    request_done(wc);
                } else {
                    wc->st = W_CDATA_END;
                    wc->cr = false;
                }
            }
            continue;
        }
        case W_CDATA_END:
        case W_TRAILER:
            /* Exactly CRLF. */
            if (!wc->cr) {
                if (c != '\r') {
                    fail(wc);
                    break;
                }
                wc->cr = true;
            } else {
                wc->cr = false;
                if (c != '\n') {
                    fail(wc);
                    break;
                }
                if (wc->st == W_TRAILER) {
                    request_done(wc);
                } else {
                    wc->st = W_CSIZE;
                    wc->remaining = 0;
                    new_line(wc);
                }
            }
            i++;
            continue;
        default:
            break;
        }
        if (wc->st == W_BAD)
            break;
        /* Line-oriented states: W_LEAD, W_HEAD, W_CSIZE. */
        i++;
        if (wc->cr) {
            wc->cr = false;
            if (c != '\n') {
                fail(wc); /* a bare CR */
                break;
            }
            if (wc->st == W_LEAD)
                continue; /* an empty line before the request line */
            if (wc->st == W_HEAD)
                head_line(wc);
            else
                csize_end(wc);
            continue;
        }
        if (c == '\r') {
            wc->cr = true;
            continue;
        }
        if (c == '\n' || c == '\0') {
            fail(wc); /* a bare LF, a NUL */
            break;
        }
        if (wc->st == W_LEAD) {
            wc->st = W_HEAD;
            wc->first_line = true;
            new_line(wc);
        }
        if (wc->st == W_CSIZE) {
            csize_byte(wc, c);
            continue;
        }
        if (wc->colon) {
            if (wc->vkind != V_NONE)
                value_byte(wc, c);
        } else if (!wc->first_line) {
            if (c == ':') {
                wc->colon = true;
                wc->name_len = wc->line_len;
                if (wc->name_len == 14 && strncasecmp(wc->line, "Content-Length", 14) == 0)
                    wc->vkind = V_CL;
                else if (wc->name_len == 17 &&
                         strncasecmp(wc->line, "Transfer-Encoding", 17) == 0)
                    wc->vkind = V_TE;
            } else {
                wc->before_colon = c;
            }
        }
        if (wc->line_len < LINE_KEEP)
            wc->line[wc->line_len] = c;
        if (wc->line_len < SIZE_MAX)
            wc->line_len++;
        i = skip_plain(wc, buf, i, n);
    }
}

/* ---- what the server asks --------------------------------------------------- */

bool wire_check_oom(const struct wire_check *wc)
{
    return wc->oom;
}

bool wire_check_head(const struct wire_check *wc)
{
    if (wc->desync || wc->oom)
        return false;
    if (wc->q_len > 0)
        return !wc->q[0].bad;
    return wc->st != W_BAD && wc->head_done;
}

bool wire_check_framed(const struct wire_check *wc, uint64_t *body_len)
{
    if (wc->desync || wc->oom || wc->q_len == 0 || wc->q[0].bad)
        return false;
    *body_len = wc->q[0].body_len;
    return true;
}

bool wire_check_end(const struct wire_check *wc, uint64_t body_len)
{
    uint64_t framed;
    return wire_check_framed(wc, &framed) && framed == body_len;
}

void wire_check_done(struct wire_check *wc)
{
    if (wc->q_len == 0) {
        wc->desync = true;
        return;
    }
    wc->q_len--;
    memmove(wc->q, wc->q + 1, wc->q_len * sizeof(*wc->q));
}

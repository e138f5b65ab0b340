/*
 * canonical_json.c - the canonical form of a JSON body (see canonical_json.h).
 *
 * Two passes. The parser reads the body once, without recursion: open
 * containers are a stack of frames, and the values of each open container
 * wait on a value stack (arrays) or member stack (objects) until it closes.
 * Then they move, once, into the container's own run of `items` or
 * `members`, and an object's run is sorted there and checked for a repeated
 * key. Scalars become nodes: a number, `true`, `false` or `null` points at
 * its text in the input, a string at its decoded bytes in `str`. The
 * writer then walks the tree from the root, again with an explicit stack.
 * Every byte of the input is read once and every value moved at most once,
 * so a deeply nested or very wide body costs time in proportion to its size
 * (plus sorting), and depth costs heap, never C stack.
 *
 * The parsing helpers return at the first byte that is not JSON rather than
 * through one exit: they hold nothing to clean up, everything they allocate
 * hangs off struct cj, which idem_canonical_json() frees once.
 */
#include "canonical_json.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum node_type { NODE_SCALAR, NODE_STRING, NODE_ARRAY, NODE_OBJECT };

/* NODE_SCALAR: in[off..off+len) is written as is (a number, true, false,
 * null). NODE_STRING: str[off..off+len) are the decoded bytes.
 * NODE_ARRAY: items[off..off+len). NODE_OBJECT: members[off..off+len),
 * sorted by key. */
struct node {
    enum node_type type;
    size_t off;
    size_t len;
};

/* An object member: its key's decoded bytes str[key_off..key_off+key_len)
 * and the node of its value. */
struct member {
    size_t key_off;
    size_t key_len;
    size_t value;
};

/* An open container; its values so far are vstack[start..] (array) or
 * mstack[start..] (object). */
struct frame {
    bool object;
    size_t start;
};

/* A container being written, and the index of its child written last. */
struct walk {
    size_t node;
    size_t next;
};

/* A growable array of elements of one size. */
struct vec {
    void *p;
    size_t n;
    size_t cap;
};

struct cj {
    const unsigned char *in;
    size_t len;
    size_t pos;
    struct vec str;     /* unsigned char: decoded strings */
    struct vec nodes;   /* struct node */
    struct vec items;   /* size_t: elements of closed arrays */
    struct vec members; /* struct member: members of closed objects */
    struct vec vstack;  /* size_t: elements of open arrays */
    struct vec mstack;  /* struct member: members of open objects */
    struct vec frames;  /* struct frame: open containers */
    struct vec walk;    /* struct walk: containers open while writing */
    struct vec out;     /* char: the canonical text */
};

/* Makes room for `more` elements of size `size` past v->n. */
static int vec_reserve(struct vec *v, size_t more, size_t size)
{
    int rc = 0;
    size_t cap = v->cap;
    void *p;

    if (more <= v->cap - v->n)
        goto out;
    if (more > SIZE_MAX / size - v->n) {
        rc = IDEM_CJSON_NOMEM;
        goto out;
    }
    if (cap < 16)
        cap = 16;
    while (cap - v->n < more) {
        if (cap > SIZE_MAX / size / 2) {
            cap = v->n + more;
            break;
        }
        cap *= 2;
    }
    p = realloc(v->p, cap * size);
    if (p == NULL) {
        rc = IDEM_CJSON_NOMEM;
        goto out;
    }
    v->p = p;
    v->cap = cap;
out:
    return rc;
}

static int vec_push(struct vec *v, const void *elem, size_t size)
{
    int rc = vec_reserve(v, 1, size);
    if (rc == 0) {
        memcpy((unsigned char *)v->p + v->n * size, elem, size);
        v->n++;
    }
    return rc;
}

#define NODES(c) ((struct node *)(c)->nodes.p)
#define ITEMS(c) ((size_t *)(c)->items.p)
#define MEMBERS(c) ((struct member *)(c)->members.p)
#define VSTACK(c) ((size_t *)(c)->vstack.p)
#define MSTACK(c) ((struct member *)(c)->mstack.p)
#define FRAMES(c) ((struct frame *)(c)->frames.p)
#define WALK(c) ((struct walk *)(c)->walk.p)
#define STR(c) ((unsigned char *)(c)->str.p)

/* ---- parsing ----------------------------------------------------------- */

/* RFC 8259 section 2: the four white space characters, nothing else. */
static void skip_ws(struct cj *c)
{
    while (c->pos < c->len) {
        unsigned char b = c->in[c->pos];
        if (b != ' ' && b != '\t' && b != '\n' && b != '\r')
            break;
        c->pos++;
    }
}

/* The next byte, or -1 at the end. */
static int peek(const struct cj *c)
{
    return c->pos < c->len ? c->in[c->pos] : -1;
}

static bool is_digit(int b)
{
    return b >= '0' && b <= '9';
}

static int new_node(struct cj *c, enum node_type type, size_t off, size_t len, size_t *index)
{
    struct node n = {type, off, len};
    *index = c->nodes.n;
    return vec_push(&c->nodes, &n, sizeof(n));
}

/* RFC 8259 section 6: -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?
 * Kept as written; only the integer -0 is written 0, as jansson did. */
static int parse_number(struct cj *c, size_t *index)
{
    size_t start = c->pos;
    bool integer = true;

    if (peek(c) == '-')
        c->pos++;
    if (peek(c) == '0') {
        c->pos++;
    } else if (is_digit(peek(c))) {
        while (is_digit(peek(c)))
            c->pos++;
    } else {
        return IDEM_CJSON_NOT_JSON;
    }
    if (peek(c) == '.') {
        integer = false;
        c->pos++;
        if (!is_digit(peek(c)))
            return IDEM_CJSON_NOT_JSON;
        while (is_digit(peek(c)))
            c->pos++;
    }
    if (peek(c) == 'e' || peek(c) == 'E') {
        integer = false;
        c->pos++;
        if (peek(c) == '+' || peek(c) == '-')
            c->pos++;
        if (!is_digit(peek(c)))
            return IDEM_CJSON_NOT_JSON;
        while (is_digit(peek(c)))
            c->pos++;
    }
    if (integer && c->pos - start == 2 && c->in[start] == '-' && c->in[start + 1] == '0')
        start++; /* "-0": the leading zero rule leaves no other "-0..." integer */
    return new_node(c, NODE_SCALAR, start, c->pos - start, index);
}

static int parse_literal(struct cj *c, size_t *index)
{
    static const char *const words[] = {"true", "false", "null"};

    for (size_t i = 0; i < sizeof(words) / sizeof(words[0]); i++) {
        size_t n = strlen(words[i]);
        if (c->len - c->pos >= n && memcmp(c->in + c->pos, words[i], n) == 0) {
            c->pos += n;
            return new_node(c, NODE_SCALAR, c->pos - n, n, index);
        }
    }
    return IDEM_CJSON_NOT_JSON;
}

static int hex4(const struct cj *c, size_t at, uint32_t *v)
{
    *v = 0;
    if (c->len - at < 4)
        return IDEM_CJSON_NOT_JSON;
    for (size_t i = 0; i < 4; i++) {
        unsigned char b = c->in[at + i];
        uint32_t d;
        if (b >= '0' && b <= '9')
            d = (uint32_t)(b - '0');
        else if (b >= 'a' && b <= 'f')
            d = (uint32_t)(b - 'a' + 10);
        else if (b >= 'A' && b <= 'F')
            d = (uint32_t)(b - 'A' + 10);
        else
            return IDEM_CJSON_NOT_JSON;
        *v = *v << 4 | d;
    }
    return 0;
}

/* Appends code point cp as UTF-8; room is reserved by the caller. */
static void put_utf8(struct cj *c, uint32_t cp)
{
    unsigned char *p = STR(c) + c->str.n;
    size_t n;

    if (cp < 0x80) {
        p[0] = (unsigned char)cp;
        n = 1;
    } else if (cp < 0x800) {
        p[0] = (unsigned char)(0xC0 | cp >> 6);
        p[1] = (unsigned char)(0x80 | (cp & 0x3F));
        n = 2;
    } else if (cp < 0x10000) {
        p[0] = (unsigned char)(0xE0 | cp >> 12);
        p[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
        p[2] = (unsigned char)(0x80 | (cp & 0x3F));
        n = 3;
    } else {
        p[0] = (unsigned char)(0xF0 | cp >> 18);
        p[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3F));
        p[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
        p[3] = (unsigned char)(0x80 | (cp & 0x3F));
        n = 4;
    }
    c->str.n += n;
}

/* The length of the well-formed UTF-8 sequence at in[pos] (RFC 3629
 * section 4: no overlong forms, no surrogates, nothing past U+10FFFF), or
 * 0. The rules of jansson's utf8_check_first/utf8_check_full. */
static size_t utf8_len(const struct cj *c, size_t pos)
{
    const unsigned char *s = c->in + pos;
    size_t avail = c->len - pos;
    size_t n;
    uint32_t cp;

    if (s[0] >= 0xC2 && s[0] <= 0xDF) {
        n = 2;
        cp = s[0] & 0x1Fu;
    } else if (s[0] >= 0xE0 && s[0] <= 0xEF) {
        n = 3;
        cp = s[0] & 0x0Fu;
    } else if (s[0] >= 0xF0 && s[0] <= 0xF4) {
        n = 4;
        cp = s[0] & 0x07u;
    } else {
        return 0;
    }
    if (avail < n)
        return 0;
    for (size_t i = 1; i < n; i++) {
        if (s[i] < 0x80 || s[i] > 0xBF)
            return 0;
        cp = cp << 6 | (s[i] & 0x3Fu);
    }
    if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000))
        return 0;
    return n;
}

/* A string at in[pos] == '"', decoded into str (RFC 8259 section 7). The
 * decoded bytes never outnumber the input bytes they come from, so str
 * is reserved once for the rest of the input. */
static int parse_string(struct cj *c, size_t *off, size_t *len)
{
    int rc = vec_reserve(&c->str, c->len - c->pos, 1);

    if (rc != 0)
        return rc;
    *off = c->str.n;
    c->pos++;
    for (;;) {
        int b = peek(c);
        if (b < 0 || b < 0x20)
            return IDEM_CJSON_NOT_JSON; /* the end, or an unescaped control character */
        if (b == '"') {
            c->pos++;
            break;
        }
        if (b < 0x80 && b != '\\') {
            STR(c)[c->str.n++] = (unsigned char)b;
            c->pos++;
        } else if (b >= 0x80) {
            size_t n = utf8_len(c, c->pos);
            if (n == 0)
                return IDEM_CJSON_NOT_JSON;
            memcpy(STR(c) + c->str.n, c->in + c->pos, n);
            c->str.n += n;
            c->pos += n;
        } else {
            uint32_t cp;
            c->pos++;
            switch (peek(c)) {
            case '"':
            case '\\':
            case '/':
                cp = c->in[c->pos];
                break;
            case 'b':
                cp = '\b';
                break;
            case 'f':
                cp = '\f';
                break;
            case 'n':
                cp = '\n';
                break;
            case 'r':
                cp = '\r';
                break;
            case 't':
                cp = '\t';
                break;
            case 'u':
                if (hex4(c, c->pos + 1, &cp) != 0)
                    return IDEM_CJSON_NOT_JSON;
                c->pos += 4;
                if (cp >= 0xDC00 && cp <= 0xDFFF)
                    return IDEM_CJSON_NOT_JSON; /* a lone low surrogate */
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    /* Only a pair makes a code point (RFC 8259 section 7). */
                    uint32_t lo;
                    if (c->len - c->pos < 7 || c->in[c->pos + 1] != '\\' ||
                        c->in[c->pos + 2] != 'u' || hex4(c, c->pos + 3, &lo) != 0 || lo < 0xDC00 ||
                        lo > 0xDFFF)
                        return IDEM_CJSON_NOT_JSON;
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    c->pos += 6;
                }
                break;
            default:
                return IDEM_CJSON_NOT_JSON;
            }
            c->pos++;
            put_utf8(c, cp);
        }
    }
    *len = c->str.n - *off;
    return 0;
}

/* An object key at in[pos], then ':'. Opens a member on mstack. */
static int parse_key(struct cj *c)
{
    struct member m = {0, 0, SIZE_MAX};
    int rc;

    skip_ws(c);
    if (peek(c) != '"')
        return IDEM_CJSON_NOT_JSON;
    rc = parse_string(c, &m.key_off, &m.key_len);
    if (rc != 0)
        return rc;
    /* jansson refuses NUL in a key (its objects are keyed by C strings). */
    if (m.key_len > 0 && memchr(STR(c) + m.key_off, '\0', m.key_len) != NULL)
        return IDEM_CJSON_NOT_JSON;
    skip_ws(c);
    if (peek(c) != ':')
        return IDEM_CJSON_NOT_JSON;
    c->pos++;
    return vec_push(&c->mstack, &m, sizeof(m));
}

/* jansson's JSON_SORT_KEYS order: memcmp of the common length, then the
 * shorter key first. */
static int member_cmp(const struct cj *c, const struct member *a, const struct member *b)
{
    size_t n = a->key_len < b->key_len ? a->key_len : b->key_len;
    int r = n > 0 ? memcmp(STR(c) + a->key_off, STR(c) + b->key_off, n) : 0;

    if (r != 0)
        return r;
    return (a->key_len > b->key_len) - (a->key_len < b->key_len);
}

static void sift_down(const struct cj *c, struct member *m, size_t root, size_t n)
{
    for (;;) {
        size_t child = 2 * root + 1;
        struct member t;
        if (child >= n)
            break;
        if (child + 1 < n && member_cmp(c, &m[child], &m[child + 1]) < 0)
            child++;
        if (member_cmp(c, &m[root], &m[child]) >= 0)
            break;
        t = m[root];
        m[root] = m[child];
        m[child] = t;
        root = child;
    }
}

/* Heapsort: n log n whatever the keys, in place, no recursion. Stability
 * does not matter: equal keys are refused. */
static void sort_members(const struct cj *c, struct member *m, size_t n)
{
    for (size_t i = n / 2; i > 0; i--)
        sift_down(c, m, i - 1, n);
    for (size_t end = n; end > 1; end--) {
        struct member t = m[0];
        m[0] = m[end - 1];
        m[end - 1] = t;
        sift_down(c, m, 0, end - 1);
    }
}

static int open_container(struct cj *c, bool object)
{
    struct frame f = {object, object ? c->mstack.n : c->vstack.n};
    c->pos++;
    return vec_push(&c->frames, &f, sizeof(f));
}

/* Closes the innermost container: its values move to their final run,
 * an object's sorted (JSON_REJECT_DUPLICATES: a key twice is refused). An
 * empty container has no run (and the vec may not be allocated yet). */
static int close_container(struct cj *c, size_t *index)
{
    struct frame f = FRAMES(c)[--c->frames.n];
    size_t off = f.object ? c->members.n : c->items.n;
    size_t count = (f.object ? c->mstack.n : c->vstack.n) - f.start;
    int rc = 0;

    if (count > 0 && f.object) {
        struct member *m;
        rc = vec_reserve(&c->members, count, sizeof(*m));
        if (rc != 0)
            goto out;
        m = MEMBERS(c) + off;
        memcpy(m, MSTACK(c) + f.start, count * sizeof(*m));
        c->members.n += count;
        c->mstack.n = f.start;
        sort_members(c, m, count);
        for (size_t i = 1; i < count && rc == 0; i++) {
            if (member_cmp(c, &m[i - 1], &m[i]) == 0)
                rc = IDEM_CJSON_NOT_JSON;
        }
    } else if (count > 0) {
        rc = vec_reserve(&c->items, count, sizeof(size_t));
        if (rc != 0)
            goto out;
        memcpy(ITEMS(c) + off, VSTACK(c) + f.start, count * sizeof(size_t));
        c->items.n += count;
        c->vstack.n = f.start;
    }
    if (rc == 0)
        rc = new_node(c, f.object ? NODE_OBJECT : NODE_ARRAY, off, count, index);
out:
    return rc;
}

/* Parses the whole input; *root is the top value's node. */
static int parse(struct cj *c, size_t *root)
{
    int rc = 0;
    size_t node = 0;

    for (;;) {
        /* A value is due. Its depth: itself plus every open container. */
        int b;
        skip_ws(c);
        if (c->frames.n >= IDEM_CJSON_MAX_DEPTH) {
            rc = IDEM_CJSON_NOT_JSON;
            goto out;
        }
        b = peek(c);
        if (b == '[' || b == '{') {
            bool object = b == '{';
            rc = open_container(c, object);
            if (rc != 0)
                goto out;
            skip_ws(c);
            if (peek(c) == (object ? '}' : ']')) {
                c->pos++;
                rc = close_container(c, &node);
            } else if (object) {
                rc = parse_key(c);
                if (rc == 0)
                    continue;
            } else {
                continue;
            }
        } else if (b == '"') {
            size_t off;
            size_t len;
            rc = parse_string(c, &off, &len);
            if (rc == 0)
                rc = new_node(c, NODE_STRING, off, len, &node);
        } else if (b == '-' || is_digit(b)) {
            rc = parse_number(c, &node);
        } else {
            rc = parse_literal(c, &node);
        }
        if (rc != 0)
            goto out;

        /* A value is done: it goes to its container, which may then close
         * (and be a value done in turn), or want its next value. */
        for (;;) {
            struct frame *f;
            if (c->frames.n == 0) {
                *root = node;
                skip_ws(c);
                if (c->pos != c->len)
                    rc = IDEM_CJSON_NOT_JSON; /* trailing bytes */
                goto out;
            }
            f = &FRAMES(c)[c->frames.n - 1];
            if (f->object)
                MSTACK(c)[c->mstack.n - 1].value = node;
            else
                rc = vec_push(&c->vstack, &node, sizeof(node));
            if (rc != 0)
                goto out;
            skip_ws(c);
            b = peek(c);
            if (b < 0) {
                rc = IDEM_CJSON_NOT_JSON; /* the end inside a container */
                goto out;
            }
            c->pos++;
            if (b == ',') {
                if (f->object)
                    rc = parse_key(c);
                if (rc != 0)
                    goto out;
                break;
            }
            if (b != (f->object ? '}' : ']')) {
                rc = IDEM_CJSON_NOT_JSON;
                goto out;
            }
            rc = close_container(c, &node);
            if (rc != 0)
                goto out;
        }
    }
out:
    return rc;
}

/* ---- writing ----------------------------------------------------------- */

static int put(struct cj *c, const void *s, size_t n)
{
    int rc = vec_reserve(&c->out, n, 1);
    if (rc == 0 && n > 0) {
        memcpy((char *)c->out.p + c->out.n, s, n);
        c->out.n += n;
    }
    return rc;
}

/* jansson's dump_string without JSON_ENSURE_ASCII or JSON_ESCAPE_SLASH: the
 * short escapes, \u00XX (upper case) for other control characters, and
 * every other byte as it is (the bytes are well-formed UTF-8). */
static int put_string(struct cj *c, size_t off, size_t len)
{
    static const char hex[] = "0123456789ABCDEF";
    const unsigned char *s = STR(c) + off;
    size_t run = 0;
    int rc = put(c, "\"", 1);

    for (size_t i = 0; rc == 0 && i < len; i++) {
        char esc[6] = {'\\', 0, '0', '0', 0, 0};
        size_t esc_len = 2;
        switch (s[i]) {
        case '"':
            esc[1] = '"';
            break;
        case '\\':
            esc[1] = '\\';
            break;
        case '\b':
            esc[1] = 'b';
            break;
        case '\f':
            esc[1] = 'f';
            break;
        case '\n':
            esc[1] = 'n';
            break;
        case '\r':
            esc[1] = 'r';
            break;
        case '\t':
            esc[1] = 't';
            break;
        default:
            if (s[i] >= 0x20)
                continue;
            esc[1] = 'u';
            esc[4] = hex[s[i] >> 4];
            esc[5] = hex[s[i] & 15];
            esc_len = 6;
            break;
        }
        rc = put(c, s + run, i - run);
        if (rc == 0)
            rc = put(c, esc, esc_len);
        run = i + 1;
    }
    if (rc == 0)
        rc = put(c, s + run, len - run);
    if (rc == 0)
        rc = put(c, "\"", 1);
    return rc;
}

/* Writes the key of member i of an object node, then ':'. */
static int put_key(struct cj *c, const struct node *obj, size_t i)
{
    const struct member *m = &MEMBERS(c)[obj->off + i];
    int rc = put_string(c, m->key_off, m->key_len);
    return rc == 0 ? put(c, ":", 1) : rc;
}

static size_t child(const struct cj *c, const struct node *n, size_t i)
{
    return n->type == NODE_OBJECT ? MEMBERS(c)[n->off + i].value : ITEMS(c)[n->off + i];
}

/* Writes the tree from the root, depth first; walk holds the open
 * containers and the index of the child written last in each. */
static int write_tree(struct cj *c, size_t root)
{
    size_t index = root;
    int rc = 0;

    for (;;) {
        const struct node *n = &NODES(c)[index];
        if (n->type == NODE_SCALAR) {
            rc = put(c, c->in + n->off, n->len);
        } else if (n->type == NODE_STRING) {
            rc = put_string(c, n->off, n->len);
        } else {
            bool object = n->type == NODE_OBJECT;
            rc = put(c, object ? "{" : "[", 1);
            if (rc == 0 && n->len > 0) {
                struct walk w = {index, 0};
                rc = vec_push(&c->walk, &w, sizeof(w));
                if (rc == 0 && object)
                    rc = put_key(c, n, 0);
                if (rc != 0)
                    goto out;
                index = child(c, n, 0);
                continue; /* down into the first child */
            }
            if (rc == 0)
                rc = put(c, object ? "}" : "]", 1);
        }
        if (rc != 0)
            goto out;

        /* Up: the next sibling, or close the container and go on up. */
        for (;;) {
            struct walk *w;
            const struct node *parent;
            if (c->walk.n == 0)
                goto out; /* the root is written */
            w = &WALK(c)[c->walk.n - 1];
            parent = &NODES(c)[w->node];
            w->next++;
            if (w->next < parent->len) {
                rc = put(c, ",", 1);
                if (rc == 0 && parent->type == NODE_OBJECT)
                    rc = put_key(c, parent, w->next);
                if (rc != 0)
                    goto out;
                index = child(c, parent, w->next);
                break;
            }
            rc = put(c, parent->type == NODE_OBJECT ? "}" : "]", 1);
            if (rc != 0)
                goto out;
            c->walk.n--;
        }
    }
out:
    return rc;
}

int idem_canonical_json(const void *in, size_t in_len, char **out, size_t *out_len)
{
    struct cj c;
    size_t root = 0;
    int rc;

    memset(&c, 0, sizeof(c));
    c.in = in;
    c.len = in_len;
    *out = NULL;
    *out_len = 0;
    rc = parse(&c, &root);
    if (rc != 0)
        goto out;
    /* Never longer than the input: one allocation. */
    rc = vec_reserve(&c.out, in_len + 1, 1);
    if (rc == 0)
        rc = write_tree(&c, root);
    if (rc == 0)
        rc = put(&c, "", 1);
    if (rc != 0)
        goto out;
    *out = c.out.p;
    *out_len = c.out.n - 1;
    c.out.p = NULL;
out:
    free(c.out.p);
    free(c.walk.p);
    free(c.frames.p);
    free(c.mstack.p);
    free(c.vstack.p);
    free(c.members.p);
    free(c.items.p);
    free(c.nodes.p);
    free(c.str.p);
    return rc;
}

const char *idem_canonical_json_strerror(int rc)
{
    switch (rc) {
    case 0:
        return "ok";
    case IDEM_CJSON_NOT_JSON:
        return "the body is not JSON this canonicaliser accepts";
    case IDEM_CJSON_NOMEM:
        return "out of memory";
    }
    return "unknown canonical JSON error";
}

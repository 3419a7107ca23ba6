/* Status names and the thread-local error message. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "backend.h"

static _Thread_local char last_error[1024];

const char *sparge_status_name(sparge_status s)
{
    switch (s) {
    case SPARGE_OK: return "SPARGE_OK";
    case SPARGE_ERR_NULL: return "SPARGE_ERR_NULL";
    case SPARGE_ERR_INVALID: return "SPARGE_ERR_INVALID";
    case SPARGE_ERR_SHAPE: return "SPARGE_ERR_SHAPE";
    case SPARGE_ERR_DTYPE: return "SPARGE_ERR_DTYPE";
    case SPARGE_ERR_OVERFLOW: return "SPARGE_ERR_OVERFLOW";
    case SPARGE_ERR_MASK: return "SPARGE_ERR_MASK";
    case SPARGE_ERR_UNSUPPORTED: return "SPARGE_ERR_UNSUPPORTED";
    case SPARGE_ERR_NO_DEVICE: return "SPARGE_ERR_NO_DEVICE";
    case SPARGE_ERR_OUT_OF_MEMORY: return "SPARGE_ERR_OUT_OF_MEMORY";
    case SPARGE_ERR_RUNTIME: return "SPARGE_ERR_RUNTIME";
    }
    return "SPARGE_ERR_UNKNOWN";
}

const char *sparge_last_error(void) { return last_error; }

sparge_status sparge_fail(sparge_status s, const char *file, int line, const char *fmt, ...)
{
    const char *base = strrchr(file, '/');
    int n = snprintf(last_error, sizeof last_error, "%s:%d: ", base ? base + 1 : file, line);
    if (n < 0 || (size_t)n >= sizeof last_error)
        return s;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error + n, sizeof last_error - (size_t)n, fmt, ap);
    va_end(ap);
    return s;
}

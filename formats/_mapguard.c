/* The one-line exit for a fault on a memory-mapped file. When a mapped file shrinks under the process
 * (truncated by another program) or its disk fails, touching the lost pages raises SIGBUS, which would
 * kill the process without a word. This handler writes the message set by formats/mapguard.py (which
 * names the files in use) and exits with status 1. Only async-signal-safe calls run in it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <signal.h>
#include <string.h>
#include <unistd.h>

static char message[4096];
static volatile sig_atomic_t message_len;
static int installed;

static void on_bus_error(int sig) {
    (void)sig;
    ssize_t rc = write(2, message, (size_t)message_len);
    (void)rc;
    _exit(1);
}

static PyObject *py_set_message(PyObject *self, PyObject *args) {
    const char *text;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y#", &text, &n)) return NULL;
    if (n > (Py_ssize_t)sizeof message) n = sizeof message;
    message_len = 0;                               /* a fault while copying writes nothing, then exits */
    memcpy(message, text, (size_t)n);
    message_len = (sig_atomic_t)n;
    if (!installed) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_bus_error;
        sigemptyset(&sa.sa_mask);
        if (sigaction(SIGBUS, &sa, NULL) != 0) return PyErr_SetFromErrno(PyExc_OSError);
        installed = 1;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"set_message", py_set_message, METH_VARARGS,
     "set_message(bytes): on SIGBUS, write these bytes to standard error and exit with status 1"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mapguard", NULL, -1, methods};

PyMODINIT_FUNC PyInit__mapguard(void) { return PyModule_Create(&module); }

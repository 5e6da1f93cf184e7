"""The frame format between a `troupe.python` actor and its worker process, as constants only.

Their home is Rust (`crates/actors/src/builtin/python_wire.rs`); its test
`python_frames_match_the_rust_ones` reads this file and fails when a name or value here differs
from the Rust side's, or when a line here is anything but a constant. Keep it that way: one
`NAME = value` per line, a string in double quotes or a decimal integer.
"""

# The environment variable naming the worker's end of the socket pair.
FD_ENV = "TROUPE_WORKER_FD"
# Each frame: its body's length as a little-endian u32 (struct's spelling), then the body.
LENGTH_FORMAT = "<I"
# The largest body either side accepts.
MAX_FRAME = 2147483648

# The first frame (Hello): what to build.
TARGET = "target"
MAIN_FILE = "main_file"
SYS_PATH = "sys_path"
INIT = "init"
# A call (Call) and its answer (Answer), matched by id.
ID = "id"
METHOD = "method"
ARGS = "args"
REPLY = "reply"
# A reply (to Hello, or an Answer's): {OK: bytes} or {RAISED: {KIND, MESSAGE, TRACEBACK}}.
OK = "Ok"
RAISED = "Raised"
KIND = "kind"
MESSAGE = "message"
TRACEBACK = "traceback"

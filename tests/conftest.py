import os
import tempfile

# One embedded-corpus cache per test session (built once, ~15 s), never the user's ~/.cache.
os.environ.setdefault("MEGALITE_CACHE", tempfile.mkdtemp(prefix="megalite-cache-"))

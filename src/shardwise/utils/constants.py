"""Values every layer agrees on (kept here, at the bottom, so no layer imports upward for them)."""

IGNORE_INDEX = -100  # a target that counts for nothing (padding): torch's cross-entropy default

import os

# The a2a-sdk traces every call of its event queue (about 45 spans an A2A message, all named after
# internals); the doors' own spans say what a request did. Set it to true to have them too. It is
# read when a2a is first imported, which in the servers is after this package.
os.environ.setdefault("OTEL_INSTRUMENTATION_A2A_SDK_ENABLED", "false")

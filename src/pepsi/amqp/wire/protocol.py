"""The AMQP 0-9-1 wire's fixed numbers: protocol headers, frame types, the frame layout.

Shared by the reader and the writer (and the server's frame_max negotiation); values
only, no logic (the reader and the writer define the frame layout's `struct`s
themselves, see there).
"""

from __future__ import annotations

from typing import Final

PROTOCOL_HEADER: Final = b"AMQP\x00\x00\x09\x01"
"""What a client sends first, and what the server answers to any header it refuses."""

# AMQP 0-9's header; RabbitMQ treats it as 0-9-1 (the two are wire compatible for the
# methods clients use), so a 0-9 client keeps working. 0-8 and 1.0 are refused.
PROTOCOL_HEADER_0_9: Final = b"AMQP\x01\x01\x00\x09"

FRAME_METHOD: Final = 1
FRAME_HEADER: Final = 2
FRAME_BODY: Final = 3
FRAME_HEARTBEAT: Final = 8
FRAME_END: Final = 0xCE
FRAME_OVERHEAD: Final = 8  # 7 header octets (type, channel, size) + the frame-end octet
FRAME_MIN_SIZE: Final = 4096  # the spec's and RabbitMQ's smallest frame_max
BASIC_CLASS_ID: Final = 60  # the only class with content in 0-9-1

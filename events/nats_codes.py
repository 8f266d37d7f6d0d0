"""nats-server's JetStream error codes (its server/errors.json) that warmboot tells apart.

One definition for every reader: the event store's error translation
(`events.jetstream.errors`), and the services' own reads of the server (`services.streams`,
`services.replies`, the registry's heartbeat bucket and roster). A module of its own, with no
imports, so that a command which reads a stream does not load the eventsourcing library to
name a code.
"""

ERR_WRONG_LAST_SEQUENCE = 10071
ERR_BATCH_WRONG_LAST_SEQUENCE = 10164
ERR_BATCH_DUPLICATE_MSG_ID = 10201
ERR_BATCH_INCOMPLETE = 10176
ERR_CLUSTER_NOT_AVAILABLE = 10008
ERR_CLUSTER_NOT_LEADER = 10009
ERR_BATCH_TOO_MANY_INFLIGHT = 10210
ERR_STREAM_NAME_IN_USE = 10058
ERR_NO_MESSAGE_FOUND = 10037  # no message found (the stream is there)
ERR_STREAM_NOT_FOUND = 10059
ERR_CLUSTER_NO_PEERS = 10005
# A replicated stream's leader refuses a message whose id another proposal, not applied yet, carries
# (two writers of one subject and version at once, or a resend racing its first attempt). Waited out:
# the next attempt finds that message stored, a conflict judged as any other (`Stream.append`).
ERR_DUPLICATE_IN_PROCESS = 10158

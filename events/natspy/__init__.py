"""Every workaround of nats-py this project relies on, in one package, each installed one way.

nats-py is the project's only NATS client; where its public API is too slow for a
replay of the log, or says less than needed, the gap is closed here and nowhere else.
Each submodule does one job (its docstring says what each workaround is for):

- `events.natspy.headers`: header blocks read and written by nats-py's rules, faster: the
  lean header parser (`parse_header_lines`, `header_values`, `header_value`), installed on a
  connection by `use_lean_headers`; `parse_header_block` (a `STREAM.MSG.GET` answer's);
  `header_block` (a block encoded once, for `publish`).
- `events.natspy.jetstream`: JetStream read without nats-py's objects (`ack_positions`,
  `ack_time` from a push delivery's reply subject, `ApiError` from an API answer's JSON),
  and the ordered consumer as this project runs it (`ORDERED_IDLE_HEARTBEAT_S`,
  `guard_recreation`).
- `events.natspy.frames`: the frame reader of a connection (`_Frames`), which reads ahead
  of nats-py's protocol parser: direct delivery from the read loop (`deliver_directly`,
  `deliver_core`, `subscribe_core`, `DirectDelivery`), and the drop of a message nats-py
  could not read (`guard_reads`).
- `events.natspy.connections`: connects given up on (`connecting`, `abandon`,
  `close_given_up`), the close of a connection that is down (`close`), and nats-py's errors
  (`ErrorsOnce`, `unless_refused`, `PublishRefused`, `refuses_sign_in`, `describe_error`).
- `events.natspy.publish`: what a connection sends (`publish`, `flush_in_order`) and requests
  answered over one inbox (`Replies`).

Nothing is defined or re-exported here: a caller imports each name from the submodule that
defines it.
"""

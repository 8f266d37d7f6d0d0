"""The infrastructure factory: reads the settings, shares a link, makes streams and recorders."""

from __future__ import annotations

from eventsourcing.persistence import (
    AggregateRecorder,
    ApplicationRecorder,
    InfrastructureFactory,
    ProcessRecorder,
    ProgrammingError,
)
from eventsourcing.utils import Environment, EnvType, resolve_topic, strtobool

from events.jetstream.layout import EVENTS_PURPOSE, stream_layout
from events.jetstream.link import ConnectOptions, acquire, release
from events.jetstream.recorders import (
    JetStreamAggregateRecorder,
    JetStreamApplicationRecorder,
    JetStreamProcessRecorder,
    JetStreamRecorder,
    JetStreamTrackingRecorder,
)
from events.jetstream.stream import Stream
from events.subjects import DEFAULT_PREFIX, check_prefix

DEFAULT_STORE_TIMEOUT = 30.0


class JetStreamFactory(InfrastructureFactory[JetStreamTrackingRecorder]):
    """The eventsourcing infrastructure factory of this module."""

    NATS_URL = "NATS_URL"
    WARMBOOT_PREFIX = "WARMBOOT_PREFIX"
    WARMBOOT_STREAM_REPLICAS = "WARMBOOT_STREAM_REPLICAS"
    WARMBOOT_STORE_TIMEOUT = "WARMBOOT_STORE_TIMEOUT"
    CREATE_TABLE = "CREATE_TABLE"

    aggregate_recorder_class = JetStreamAggregateRecorder
    application_recorder_class = JetStreamApplicationRecorder
    tracking_recorder_class = JetStreamTrackingRecorder
    process_recorder_class = JetStreamProcessRecorder

    def __init__(self, env: Environment | EnvType | None):
        super().__init__(env)
        self.prefix = check_prefix(self.env.get(self.WARMBOOT_PREFIX) or DEFAULT_PREFIX)
        self.replicas = int(self.env.get(self.WARMBOOT_STREAM_REPLICAS) or 1)
        self.budget = float(self.env.get(self.WARMBOOT_STORE_TIMEOUT) or DEFAULT_STORE_TIMEOUT)
        self.options = ConnectOptions.from_env(self.env)
        self.link = acquire(self.options)
        self._closed = False

    def _create(self) -> bool:
        return bool(strtobool(self.env.get(self.CREATE_TABLE) or "yes"))

    def _stream(self, purpose: str) -> tuple[Stream, str]:
        """The stream of `purpose` (ready to use) and the subject namespace of its aggregates."""
        layout = stream_layout(self.prefix, purpose)
        stream = Stream(self.link, layout.name, layout.subjects, self.replicas, self.budget, layout.per_subject_limit)
        self.link.call(stream.ensure(self._create()))
        return stream, layout.namespace

    def aggregate_recorder(self, purpose: str = EVENTS_PURPOSE) -> AggregateRecorder:
        stream, namespace = self._stream(purpose)
        return self.aggregate_recorder_class(stream, self.prefix, namespace)

    def application_recorder(self) -> ApplicationRecorder:
        cls = self._recorder_class(self.APPLICATION_RECORDER_TOPIC, self.application_recorder_class)
        stream, namespace = self._stream(EVENTS_PURPOSE)
        return cls(stream, self.prefix, namespace)

    def tracking_recorder(
        self, tracking_recorder_class: type[JetStreamTrackingRecorder] | None = None
    ) -> JetStreamTrackingRecorder:
        cls = tracking_recorder_class or self._recorder_class(
            self.TRACKING_RECORDER_TOPIC, self.tracking_recorder_class
        )
        stream, namespace = self._stream(EVENTS_PURPOSE)
        return cls(stream, self.prefix, namespace)

    def process_recorder(self) -> ProcessRecorder:
        cls = self._recorder_class(self.PROCESS_RECORDER_TOPIC, self.process_recorder_class)
        stream, namespace = self._stream(EVENTS_PURPOSE)
        return cls(stream, self.prefix, namespace)

    def _recorder_class(self, topic_key: str, default: type) -> type:
        topic = self.env.get(topic_key)
        if not topic:
            return default
        cls = resolve_topic(topic)
        if not (isinstance(cls, type) and issubclass(cls, JetStreamRecorder)):
            raise ProgrammingError(f"{topic_key}={topic!r} is not a JetStream recorder class")
        return cls

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            release(self.link)

"""The eventsourcing library's own recorder and application test cases, run against
`events.jetstream` on the session's real nats-server, each test on a fresh prefix.

The library modules are imported whole, not their classes: pytest collects every
unittest.TestCase in a test module's namespace, the abstract ones included."""

from __future__ import annotations

import os
import uuid

import pytest
from eventsourcing.persistence import InfrastructureFactory
from eventsourcing.tests import application as library_application
from eventsourcing.tests import persistence as library_persistence
from eventsourcing.utils import Environment, get_topic

from events.jetstream import (
    JetStreamAggregateRecorder,
    JetStreamApplicationRecorder,
    JetStreamFactory,
    JetStreamProcessRecorder,
    JetStreamTrackingRecorder,
)
from services.process import store_env


@pytest.fixture(autouse=True)
def _server_url(request, nats_url):
    """unittest-style cases cannot take fixtures: hand them the session server's URL."""
    if request.cls is not None:
        request.cls.nats_url = nats_url


class OnJetStream:
    """A fresh prefix per test; every factory made here is closed after it."""

    nats_url: str

    def setUp(self) -> None:
        self.prefix = "t" + uuid.uuid4().hex[:12]
        self.factories: list[JetStreamFactory] = []
        super().setUp()

    def tearDown(self) -> None:
        super().tearDown()
        for factory in self.factories:
            factory.close()

    def store_env(self) -> dict[str, str]:
        return store_env(self.nats_url, self.prefix)

    def factory(self) -> JetStreamFactory:
        factory = JetStreamFactory(Environment(env=self.store_env()))
        self.factories.append(factory)
        return factory


class TestAggregateRecorder(OnJetStream, library_persistence.AggregateRecorderTestCase):
    def create_recorder(self) -> JetStreamAggregateRecorder:
        return self.factory().aggregate_recorder()


class TestSnapshotRecorder(OnJetStream, library_persistence.AggregateRecorderTestCase):
    def create_recorder(self) -> JetStreamAggregateRecorder:
        return self.factory().aggregate_recorder("snapshots")


class TestApplicationRecorder(OnJetStream, library_persistence.ApplicationRecorderTestCase):
    def create_recorder(self) -> JetStreamApplicationRecorder:
        return self.factory().application_recorder()

    def test_insert_subscribe(self) -> None:
        self.optional_test_insert_subscribe()


class TestNonInterleavingNotificationIDs(OnJetStream, library_persistence.NonInterleavingNotificationIDsBaseCase):
    def create_recorder(self) -> JetStreamApplicationRecorder:
        return self.factory().application_recorder()


class TestTrackingRecorder(OnJetStream, library_persistence.TrackingRecorderTestCase):
    def create_recorder(self) -> JetStreamTrackingRecorder:
        return self.factory().tracking_recorder()


class TestProcessRecorder(OnJetStream, library_persistence.ProcessRecorderTestCase):
    def create_recorder(self) -> JetStreamProcessRecorder:
        return self.factory().process_recorder()


class TrackingRecorderSubclass(JetStreamTrackingRecorder):
    pass


class TestFactory(OnJetStream, library_persistence.InfrastructureFactoryTestCase[JetStreamFactory]):
    def setUp(self) -> None:
        self.prefix = "t" + uuid.uuid4().hex[:12]
        self.env = Environment("TestCase", self.store_env_of(self.prefix))
        super().setUp()

    def store_env_of(self, prefix: str) -> dict[str, str]:
        return store_env(self.nats_url, prefix)

    def expected_factory_class(self) -> type[JetStreamFactory]:
        return JetStreamFactory

    def expected_aggregate_recorder_class(self) -> type[JetStreamAggregateRecorder]:
        return JetStreamAggregateRecorder

    def expected_application_recorder_class(self) -> type[JetStreamApplicationRecorder]:
        return JetStreamApplicationRecorder

    def expected_tracking_recorder_class(self) -> type[JetStreamTrackingRecorder]:
        return JetStreamTrackingRecorder

    def tracking_recorder_subclass(self) -> type[JetStreamTrackingRecorder]:
        return TrackingRecorderSubclass

    def expected_process_recorder_class(self) -> type[JetStreamProcessRecorder]:
        return JetStreamProcessRecorder


class TestExampleApplication(OnJetStream, library_application.ExampleApplicationTestCase):
    """The library's bank-account application (with snapshotting) on this module."""

    expected_factory_topic = get_topic(JetStreamFactory)

    def setUp(self) -> None:
        super().setUp()
        self.saved_env = {key: os.environ.get(key) for key in self.store_env()}
        os.environ.update(self.store_env())  # the case builds its app from os.environ

    def tearDown(self) -> None:
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        super().tearDown()


def test_persistence_module_setting_selects_this_factory(nats_url, prefix):
    factory = InfrastructureFactory.construct(Environment(env=store_env(nats_url, prefix)))
    try:
        assert type(factory) is JetStreamFactory
    finally:
        factory.close()

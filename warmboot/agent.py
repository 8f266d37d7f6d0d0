"""The worker agent: tells the registry, and keeps telling it, what this worker runs.

`warmboot agent --nats URL --worker-id ID --node NODE --config FILE` reads a TOML
file (see examples/agent.toml) that declares the worker's capacity, labels and,
per sandbox class, the default runtime and the restorable runtimes. A runtime is a
probe profile (`gvisor` or `microvm`: which CPU attributes `events.probe` reads
from this machine) plus literal attributes (the runtime's asset digests), or
literal attributes alone; with its informational name, actor overhead and the
versions it is compatible with (`compatible_versions`, one-way edges: each given
the same way, probed or literal). The file, and the registration it makes on this
machine, are `warmboot.agent_config`'s; this module runs the agent.

The agent then:
- registers (`<prefix>.registry.register.<worker_id>`), and heartbeats at a third
  of the TTL the registry answers; while the registry does not answer, it asks
  again more often as the TTL of its last stored beat runs out, so that it is
  heard as soon as the registry is back; with a node token file (`--node-token-file`),
  every registration carries the token of the disk its node's LOCAL snapshots are on
  (`NodeToken`, read, or made, once at the start);
- re-registers when the file's content changes, or what the probe reads of this
  machine (read again every second and before every heartbeat: a CPU that changed
  under it), so an operator rolls out v2 by making it the default and moving v1
  into `restorable_runtimes`;
  an edit the agent cannot use (bad TOML, a rule broken) is logged and the last
  good registration stays in force, and so does one the registry refuses (a change
  of class), but not the CPU in it: that registration is sent again made on the
  machine as it is now (`RESTAMP`), or, should that be impossible or refused, the
  worker is removed until it can be (`_withdraw`); a probed runtime is registered
  only with every key its profile probes;
- after the connection comes back (a NATS restart) heartbeats at once, and
  re-registers beside its heartbeats, not holding them on it (a fleet re-registering
  at once keeps the registry busy for tens of seconds; its heartbeats are answered
  meanwhile); re-registers when a heartbeat answers NOT_FOUND (the worker was
  removed, e.g. as LOST): with what the file and the probe say now (a change of
  class the registry refused is taken up by that new life); each heartbeat names the
  revision of its last registration the registry answered, and one the registry refuses
  for it registers this machine again, above that revision, once for each registration of
  its own (if refused, the beats keep nothing alive until the worker is removed as LOST, and
  registered anew): the registration in force is its own earlier one (a crash rolled the
  log back); but when the refusal names a revision above every one this agent made
  (another agent of the worker id registered it since: a twin, on another node or on this
  one, or the machine's replacement), the agent stops (`Superseded`; `warmboot
  agent` exits 1 saying so, without draining), and the newest keeps the worker: one take,
  not one at each beat of the two; with a state file, the stop is recorded beside it
  (`SupersededRecord`), and the next process beats first: while that other registration is
  in force it does not register (`StillSuperseded`, exit 3), else it clears the record and
  registers; a worker whose agent runs is a worker in service;
  registrations are sent one after the other, after the first none holds up the heartbeats
  (nor does an edit's), and each sends what the file and the probe say when its turn comes
  (docs/registry.md, "The agent");
- drains the worker, before its next beat, when a registration is refused for its size
  (`events.errors.too_large`: its body past what NATS carries or the registry decodes, the latter
  refused by the agent itself, nothing sent, or an
  event it writes, such as its RuntimeChanged carrying the previous classes too, past the
  server's max_payload): the registration in force, which the file no longer makes, takes no
  placements; no beat is sent while that drain is not answered (`_out_of_placement`;
  docs/contract.md, "A registration too large for one event");
- on SIGTERM/SIGINT drains the worker first if asked (`--drain-on-exit`), then
  stops; if its registration was still on its way, the drain waits for it (up to
  EXIT_ASKS_S, 5 s from the stop with the beat before it). A drained worker stays drained when its agent comes back before
  the registry's TTL; once removed as LOST it registers anew, undrained;
- says, once per drain, that the worker is drained (`worker W is drained (seq N, reason
  '...')`, a warning), when a heartbeat's answer names a drain it has not said nor sent
  itself (`HeartbeatReply.drained`, a project addition): an operator's `warmboot worker drain`,
  or, after the agent's restart, the drain in force before it (its own at exit included). A
  registry of an earlier version says nothing of drains, and neither does the agent.

Requests use the inbox prefix `_INBOX.<worker_id>` so that, with the
configuration of `warmboot nats-config`, a worker's credentials can receive
replies to its own requests and no one else's.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import time
import uuid
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import Any, Callable

import msgspec
import nats
from nats.aio.client import Client as NATS

from events.errors import ContractError, in_force_named, latest_revision, too_large
from events.tasks import cancel_and_wait
from events.natsauth import env_sign_in, nkey_options, nkey_seed_path, redact_url
from events.natspy.connections import ErrorsOnce, abandon, close_within, closed_for_good, connecting, describe_error
from events.natspy.frames import guard_reads
from events.compat import compat_key
from events.runtime_id import short_id
from events.schema import (
    DrainWorker,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    RegisterOutcome,
    RegisterReply,
    RegisterWorker,
    RemoveWorker,
    SeqReply,
)
from events.subjects import DEFAULT_PREFIX, check_prefix
from warmboot.agent_config import (AgentConfig, ConfigError, MachineMismatch, MachineRead, NotRegistrable,
                                   ProbeSettings, build_registration, parse_config)
from warmboot.client import Client
from warmboot.connection import sign_in_hint
from warmboot.agent_rules import (StillSuperseded, Superseded, drain_to_say, said_drained, still_superseded,
                                  superseded_by)
from warmboot.agent_state import NodeToken, RevisionFile, StateFileError, SupersededRecord


def _classes(registration: RegisterWorker) -> set[str]:
    return {entry.sandbox_class for entry in registration.sandbox_classes}


def _runtimes(registration: RegisterWorker) -> dict[tuple, tuple[str | None, str]]:
    """The runtimes a registration offers (default and restorable, not edges): compat key -> (its
    class and name, or None without a name; its label, `<class> <name> (rt-...)` with the id the
    views print)."""
    offered = {}
    for entry in registration.sandbox_classes:
        for runtime in (entry.default_runtime, *entry.restorable_runtimes):
            key = compat_key(entry.sandbox_class, runtime.version)
            named = None if runtime.name is None else f"{entry.sandbox_class} {runtime.name}"
            offered[key] = (named, f"{named or entry.sandbox_class + ' runtime'} ({short_id(key)})")
    return offered


class Latest(enum.Enum):
    """What `Agent.register` sends when its turn comes, chosen from what the file and the probe say then."""

    EDIT = "edit"  # an edit of the file, or a change of what the probe reads
    AGAIN = "again"  # after a reconnect, or a NOT_FOUND
    RESTAMP = "restamp"  # the registration in force, made again on the CPU the machine has now


EDIT, AGAIN, RESTAMP = Latest.EDIT, Latest.AGAIN, Latest.RESTAMP

# What a registration was made of: the file's configuration, and what the probe read of the
# machine then (`Agent._probed`). A registration is sent as its configuration makes it on the
# machine as it is when it is sent (`Agent._send`).
MadeOf = tuple["AgentConfig", tuple]

log = logging.getLogger("warmboot.agent")

DEFAULT_TTL_S = 15.0  # until the registry says otherwise
MIN_TTL_S = 1.0  # the shortest TTL a registry runs with
HEARTBEATS_PER_TTL = 3
# How often the agent reads what the probe reports of the machine again; and it reads it before every
# heartbeat. A CPU that changes under a running machine (a virtual machine moved to another host) is
# registered for as long as the agent has not read it: placements meanwhile send images of the old
# CPU there (found by an audit: 10 s until 2026-12-04). A read costs 0.35 ms on 2 cores and about
# 3 ms (parsing) for 128.
PROBE_INTERVAL_S = 1.0
# How long the probe must fail to read the machine (on two reads at least) before the agent takes it
# for good and removes the worker: a failure shorter than this passes (the machine is read every second
# now, and a second of unreadable cpuinfo removed the worker and released its actors: found by a review).
UNREADABLE_GRACE_S = 10.0
# A registration made again on an unchanged read of the machine (`RESTAMP`, after one that was not
# taken, or for a worker removed for want of one) is asked again at most this often; a new read asks
# at once.
RESTAMP_AGAIN_S = 10.0
RETRY_MIN_S, RETRY_MAX_S = 0.2, 5.0
REQUEST_TIMEOUT_S = 5.0
# A registration beside the heartbeats waits this long for its answer before it is sent
# again: nothing waits for it, and when a fleet registers at once (a NATS restart, a
# rollout) the registry takes tens of seconds to answer them all; a repeat every 5 s
# would cost it as much as each first answer.
BACKGROUND_REGISTER_TIMEOUT_S = 30.0


class Outdated(Exception):
    """A request retried no longer says what the machine is: made again by its sender."""


class Stale(Exception):
    """A registration the registry did not take is not sent again while the worker stays registered:
    the registration in force claims a CPU the machine no longer has, and the registry refused it for
    the worker's write budget or has taken none for a TTL (`Agent._wait_no_longer`); its sender removes
    the worker meanwhile."""


# How long the beat at the start of an agent that stopped as Superseded is asked again while the registry
# does not answer (`Agent._check_still_superseded`); then it registers, as without the record.
START_CHECK_S = DEFAULT_TTL_S
# The exit's steps before the close, counted from the stop: the end of its serving tasks (a beat in flight
# whose cancellation nats-py swallows ends at its own time-out, up to 5 s) and the two asks of the registry
# (`--drain-on-exit`: the beat asking whether the agent still holds the worker, 2 s at most, then the drain),
# all together: what the serving tasks took, the asks do not get (each asked for 0.1 s at least). With NATS
# frozen or gone, and the close's CLOSE_GIVEN_UP_S, the stop stays well within StopBound's STOP_BOUND_S (it
# took up to 9 s, and 12 where a beat in flight ignored its cancellation: past the bound, exit status 1).
EXIT_ASKS_S = 5.0
EXIT_ASK_LEAST_S = 0.1


# --- the agent ----------------------------------------------------------------------------


class Agent:
    """One worker's agent. `await run(stop)` until `stop` is set; see the module docstring."""

    def __init__(
        self,
        nats_url: str,
        worker_id: str,
        node: str,
        config_path: str | Path,
        *,
        prefix: str = DEFAULT_PREFIX,
        drain_on_exit: bool = False,
        watch_interval_s: float = 1.0,
        probe: ProbeSettings = ProbeSettings(),
        probe_interval_s: float = PROBE_INTERVAL_S,
        unreadable_grace_s: float = UNREADABLE_GRACE_S,
        inbox_prefix: str | None = None,
        nkey_seed: str | None = None,
        state_file: str | Path | None = None,
        node_token_file: str | Path | None = None,
    ):
        self.nats_url = nats_url
        self.nkey_seed = nkey_seed_path(nkey_seed)  # a seed file, or $NATS_NKEY_SEED
        self.worker_id = worker_id
        self.node = node
        self.config_path = Path(config_path)
        self.prefix = check_prefix(prefix)
        self.drain_on_exit = drain_on_exit
        self.watch_interval_s = watch_interval_s
        self.probe = probe
        self.probe_interval_s = probe_interval_s
        self.unreadable_grace_s = unreadable_grace_s
        self._probe_read: tuple[float, MachineRead, tuple] | None = None  # (when, the read, its reading)
        # the read the last RESTAMP was asked on: when, and its reading
        self._restamp_asked: tuple[float, tuple] | None = None
        self._unreadable_at: float | None = None  # the first of the reads the probe fails, in a row (`_unreadable`)
        self._stale_since: float | None = None  # monotonic time `_why_stale` first gave its present reason
        self.inbox_prefix = inbox_prefix or f"_INBOX.{worker_id}"
        self.ttl_s = DEFAULT_TTL_S
        self._ttl_learnt = False  # ttl_s is the registry's (a heartbeat answered), not the default
        self.nc: NATS | None = None
        self.registration: RegisterWorker | None = None  # the one in force
        self._in_force_of: MadeOf | None = None  # what the registration in force was made of
        self.registered: RegisterReply | None = None  # the registry's last answer to it
        self.desired: RegisterWorker | None = None  # what the file and the probe said when last read
        self._desired_of: MadeOf | None = None
        self.withdrawn = False  # removed by this agent: no registration of the CPU it has now could be made
        self.sent_registration = False  # the registry may know this worker (a reply may be in flight)
        self.registering = False  # a registration is on its way (sent, not answered)
        self.beat_at: float | None = None  # monotonic time a beat the registry stored was sent
        self._read: tuple | None = None  # (the file's digest, what the probe read) when last read
        self._reconnected = asyncio.Event()
        self._one_registration = asyncio.Lock()  # registrations are sent one after the other
        self._edited: RegisterWorker | None = None  # the last edit sent
        self._edit_refused = False  # the last edit was refused (sent, or past MAX_BODY), and the file still says something else
        self._edit_waiting = False  # a register(EDIT) waits its turn
        self._again_waiting = False  # a register(AGAIN) waits its turn
        # what the probe read of the machine for a register(AGAIN) that could not be made of it (so not
        # sent): a read that says otherwise asks for it again (`_look`); None if none is owed
        self._again_unmade: tuple | None = None
        self._restamp_waiting = False  # a register(RESTAMP) waits its turn
        self._beat_soon = False  # a heartbeat was refused before the TTL was learnt: beat again soon
        self.edited = False  # whether the last read of the file found it edited (else the machine changed)
        self._config_failed = False  # whether the last read of the file (or the machine) made no registration
        # why the file could not be read when last tried (None: it was read): a file that stays unreadable is
        # said once, not at every watch (`_read_config`)
        self._unreadable_file: str | None = None
        self._background: set[asyncio.Task[None]] = set()  # registrations the heartbeats do not wait for
        # Every registration carries a revision (docs/contract.md): the same for the same content, higher
        # for other content, read off this clock (ms), so that a later process of this agent goes on above.
        self.clock_ms = lambda: time.time_ns() // 1_000_000
        # With a state file, the last revision made is kept there before it is sent, and a later
        # process goes on above it, whatever the clocks say (`RevisionFile`).
        self.state = RevisionFile(Path(state_file), worker_id) if state_file is not None else None
        self._revision = self.state.read() if self.state is not None else 0
        # beside it, whether this agent stopped as Superseded (`SupersededRecord`): checked at the start
        self.superseded_record = SupersededRecord(Path(state_file), worker_id) if state_file is not None else None
        self._was_superseded = self.superseded_record.read() if self.superseded_record is not None else None
        # With a node token file, the token of the disk this node's LOCAL snapshots are on, read (made if absent)
        # once, here, and carried by every registration (`NodeToken`); None: registrations carry none.
        self.node_token: str | None = None
        if node_token_file is not None:
            token_file = NodeToken(Path(node_token_file))
            self.node_token = token_file.read_or_make()
            if token_file.made:  # a new disk, or one whose file was deleted: said, as its effect is not small
                log.warning(
                    "node token file %s was absent: made node token %s, a new disk of node %s (or the node's first "
                    "token: its images written before any token are taken as the first token's disk's). LOCAL "
                    "snapshots this node wrote on a disk of another token are not restored here, and if worker %s "
                    "registered another token, its life ends at this registration (its running actors released). If "
                    "the disk that holds them is only not mounted: stop the agent, delete %s, mount the disk, start "
                    "the agent",
                    token_file.path, self.node_token, node, worker_id, token_file.path)
            else:
                log.info("node token %s (file %s)", self.node_token, token_file.path)
        self._revised: RegisterWorker | None = None  # the content `_revision` was given to
        self._in_force_revision: int | None = None  # the revision the registration in force was answered with
        # the revision each heartbeat names: that of this agent's last registration the registry answered,
        # until another is answered (not forgotten with `_in_force_revision`: a beat naming none would keep
        # alive whatever registration holds the worker, another machine's included)
        self._beats: int | None = None
        self._beats_refused: int | None = None  # the `_beats` a refused beat registered this machine again for
        # the sequence of the latest drain this process said, or sent itself (`drain_to_say`); 0: none
        self._drain_known = 0
        # another agent of this worker id registered it since: this one stops (`run` raises it)
        self.superseded: Superseded | None = None
        self._superseding = asyncio.Event()  # set with `superseded`: wakes the loop of a refusal in a background beat
        # The refusal of this agent's last registration for its size (`events.errors.too_large`: its body, or
        # an event it writes, past what NATS carries): the registration in force is not what the file and the probe make, and
        # no registration in this life can replace it. Until one is taken, the worker is drained before it is
        # beaten again (`_out_of_placement`); None once one is taken (or the file makes the one in force again).
        self._too_large: ContractError | None = None
        self._drained_too_large = False  # the drain for `_too_large` is in the log (this life's), or the worker is in none
        # The agent's own refusal of what the file makes as last read (`_sync_config`): its registration past
        # MAX_BODY, on the machine as the probe read it then (an edit, or a new reading of the machine), nothing
        # sent; None once a read of the file makes a registration (not a typo made since, nor a read the probe
        # fails: what the file makes is not known to fit). While it is held, nothing this agent registers is what
        # the file makes: a registration taken (an earlier edit on its way, the registration in force made again
        # on another CPU) does not end `_too_large`, and none is sent that could begin a life (`_again`, an edit
        # waiting its turn, a RESTAMP of a removed worker).
        self._file_too_large: NotRegistrable | None = None
        # the connection's errors, once each while they repeat; a refused sign-in says which credentials to check
        self._errors = ErrorsOnce(log, redact_url(nats_url), sign_in_hint(nats_url, self.nkey_seed, {}))

    # --- configuration -------------------------------------------------------------------

    def _read_config(self) -> RegisterWorker | None:
        """The registration of the file on this machine as they are now; None if neither the
        file's content nor what the probe reads of the machine changed since the last read, or
        if the file still cannot be read, as the last read said (ConfigError once, not at every
        watch: a file moved away flooded the log; what it reads next is handled as an edit).

        The file is small and read whole each time: an mtime can miss an edit made
        within its granularity, a content digest cannot. What the probe reports is read
        again now and then (`_probed`): a CPU can change under a running machine (a virtual
        machine moved to another host).
        """
        try:
            data = self.config_path.read_bytes()
        except OSError as e:
            self._read = None  # what comes back, even as it was, is read anew (and its mend said)
            error = f"{self.config_path}: cannot read: {e}"
            if error == self._unreadable_file:
                return None  # said already: nothing new until the file reads again, or fails otherwise
            self._unreadable_file = error
            self.edited = True  # a file gone (moved away, its permissions taken) is an edit of it
            raise ConfigError(error) from None
        self._unreadable_file = None
        _, machine, reading = self._machine()
        read = (hashlib.sha256(data).digest(), reading)
        if read == self._read:
            return None
        self.edited = self._read is None or read[0] != self._read[0]
        self._read = read
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{self.config_path}: not UTF-8: {e}") from None
        config = parse_config(text, str(self.config_path))
        registration = self._build(config, machine)
        self.desired, self._desired_of = registration, (config, reading)
        return registration

    def _build(self, config: AgentConfig, machine: MachineRead) -> RegisterWorker:
        """The registration `config` makes on `machine`; its errors name the file (`build_registration`)."""
        return build_registration(config, self.worker_id, self.node, machine, str(self.config_path), self.node_token)

    def _machine(self, fresh: bool = False) -> tuple[float, MachineRead, tuple]:
        """The machine as last read (when, the read, what it says: `MachineRead.reading`), read
        again every `probe_interval_s` (reading /proc/cpuinfo is not free on a machine of many
        cores), or now if `fresh`. A registration is made of one read, and known by its reading."""
        now = time.monotonic()
        if fresh or self._probe_read is None or now - self._probe_read[0] >= self.probe_interval_s:
            machine = self.probe.read()
            self._probe_read = (now, machine, machine.reading())
        return self._probe_read

    # --- talking to the registry -----------------------------------------------------------

    async def _connect(self, stop: asyncio.Event) -> NATS | None:
        """Connect, waiting for the server as long as it takes; None once stopped (a cancellation of
        the caller stays the caller's)."""

        async def reconnected() -> None:
            log.info("reconnected to NATS")
            self._errors.reset()
            self._reconnected.set()

        delay = RETRY_MIN_S
        while True:
            attempt = asyncio.ensure_future(connecting(  # ends when cancelled, closing what it made
                nats.NATS(),
                servers=[url.strip() for url in self.nats_url.split(",")],  # a cluster: its members
                name=f"warmboot-agent-{self.worker_id}",
                inbox_prefix=self.inbox_prefix,
                max_reconnect_attempts=-1,  # also retries the first connection
                reconnect_time_wait=0.5,
                reconnected_cb=reconnected,
                error_cb=self._errors.report,
                connect_timeout=2,
                **env_sign_in(self.nats_url),  # $NATS_CREDS, $NATS_USER/$NATS_PASSWORD, $NATS_TOKEN
                **nkey_options(self.nkey_seed),
            ))
            stopping = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({attempt, stopping}, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:  # cancelled: a connection made meanwhile is nobody's
                stopping.cancel()
                await abandon(attempt)
                raise
            stopping.cancel()
            if not attempt.done():  # stopped before the server answered
                await abandon(attempt)
                return None
            try:
                nc = attempt.result()
            except Exception as e:  # refused outright (e.g. bad credentials): try again, slower
                log.warning("cannot connect to NATS: %s; retrying in %.1fs", e, delay)
                if await _wait(stop, delay):
                    return None
                delay = next_delay(delay)
                continue
            self._errors.reset()
            guard_reads(nc)  # a message nats-py cannot read is dropped, not the end of its read loop
            return nc

    async def _request(self, verb: str, body: Any, reply_type: type, stop: asyncio.Event | None,
                       also_retry: tuple[ErrorCode, ...] = (), timeout: float = REQUEST_TIMEOUT_S,
                       stale: Callable[[bool, int], str | None] = lambda refused_for_budget, failures: None,
                       current: Callable[[], bool] = lambda: True):
        """A request, retried while the registry is unreachable (UNAVAILABLE, a time-out, or
        `also_retry`) or busy (RESOURCE_EXHAUSTED, which the registry answers when the worker's write
        budget is spent, `services.registry.budget`, or it works on a few of the worker's requests
        already) unless stopped; not once `stale(refused for the budget)` gives a reason (`Stale`:
        the caller removes the worker rather than wait, `_wait_no_longer`); and none once the body is
        no longer `current()` (`Outdated`, for the caller to make it again). One that beats (a
        heartbeat, a registration) records when it was sent (`beat_at`), and its retries come closer
        together as that beat's TTL runs out."""
        # One attempt per call of the client (warmboot.client: the one way a request is made);
        # the agent's own loop retries, without bound until stopped, as a worker in service must.
        client = Client(self.nc, self.prefix, timeout=timeout, attempts=1, refusals_final=False)
        beats = verb in ("heartbeat", "register")
        delay = RETRY_MIN_S
        failures = 0  # in a row, of this body
        while True:
            if not current():
                raise Outdated(f"the {verb} on its way is no longer what the file makes of this machine")
            sent = time.monotonic()
            try:
                reply = await client.request("registry", verb, self.worker_id, body, reply_type)
                if beats:
                    self.beat_at = sent
                return reply
            except ContractError as e:
                busy = e.code is ErrorCode.RESOURCE_EXHAUSTED
                if (e.code is not ErrorCode.UNAVAILABLE and e.code not in also_retry and not busy) or stop is None:
                    raise
                budget, failure = busy and e.field == "worker_id", e.message  # (the other: too many at once)
            except Exception as e:  # connection closed or reconnecting
                if stop is None:
                    raise
                budget, failure = False, str(e)
            self._check_not_denied()
            failures += 1
            why = stale(budget, failures)
            if why is not None:
                raise Stale(f"{why} ({failure})")
            log.warning("%s: %s; retrying in %.1fs", verb, failure, delay)
            if await _wait(stop, delay):
                raise asyncio.CancelledError
            left = self.beat_at + self.ttl_s - time.monotonic() if beats and self.beat_at is not None else None
            delay = next_delay(delay, left, self.ttl_s)

    def _check_not_denied(self) -> None:
        """Before the first registration is answered, a permissions violation NATS reported on this
        connection ends the agent (ConfigError): its credentials are not this worker's (another
        worker's, or a client's), and asking again would only be refused again, for ever."""
        denied = self._errors.denied
        if self.registered is None and denied is not None:
            raise ConfigError(f"NATS refuses this agent: {describe_error(denied)}. Are the credentials those of "
                              f"worker {self.worker_id!r} (--worker-id; the user in --nats or $NATS_URL, "
                              "$NATS_USER, or --nkey-seed)?")
        if self.nc is not None and self.nc.is_closed:
            # nats-py closes a connection for good on a server's -ERR (an 'Authorization Violation' when a
            # reload revokes this user's password), and never reconnects it: end, for a supervisor to restart
            raise ConfigError(closed_for_good(self.nc, "this agent's"))

    async def register(self, registration: RegisterWorker | Latest, stop: asyncio.Event) -> RegisterReply | None:
        """Register `registration` (one request_id across retries), then heartbeat to learn the TTL.

        One at a time: a registration is sent once the one before it is answered, so an older
        one is never decided after a newer one (a retry of the older one carries its request
        id, which the registry answers without writing again; a copy of it decided late, even
        from an earlier process of this agent or after a removal, carries a lower revision,
        which the registry refuses: `_revision_of`). `EDIT` and `AGAIN` choose what
        to send when their turn comes, from what the file and the probe say then (`desired`):
        - `EDIT` (an edit, or a change of what the probe reads): `desired`, unless it is the
          registration in force or the last edit sent; reads made while it waited are not
          sent one by one, only the last; None when there was nothing to send;
        - `AGAIN` (after a reconnect, or a NOT_FOUND): `desired` if it differs from the
          registration in force (a new life takes up a change of class the last one was
          refused), else, or when the registry refuses it (the worker is still alive), the
          registration in force (re-sent, should the server have lost a write). If that one
          begins a new life all the same (the worker was removed in between), the new life has
          classes the file no longer lists: it is ended, and one begun with `desired`
          (`_life_of_the_file`);
        - `RESTAMP` (the CPU changed under the registration in force, and no edit says so: the
          file is unusable, or the registry refused it): the registration in force, made again
          on the machine as it is now. Should that be impossible (the probe cannot read the
          machine) or refused, the worker is removed (`_withdraw`): a worker never stays
          registered with a CPU its machine no longer has, where images of that CPU would be
          sent to it and crash. Should it begin a new life (the worker was removed), that life
          takes what the file makes (`_life_of_the_restamp`).
        Whatever is sent is made on the machine as it is then (`_send`).
        """
        async with self._one_registration:
            if registration is RESTAMP:
                self._restamp_waiting = False
                reply = await self._restamp(stop)
                if reply is None:
                    return None
            elif self.withdrawn and registration is AGAIN:
                self._again_waiting = False
                return None  # removed on purpose: `_keep_cpu_true` tries again (RESTAMP)
            elif registration is EDIT:
                self._edit_waiting = False
                wanted = self.desired
                if wanted is None or (wanted == self.registration and not self.withdrawn) or wanted == self._edited:
                    return None  # in force already, or sent already (and refused: not asked again)
                if self._file_too_large is not None:
                    return None  # read since: the file makes a registration past MAX_BODY, which is not sent
                self._edited = wanted
                try:
                    try:
                        # to a worker this agent removed, it begins a new life: it follows the file (`_send`)
                        reply = await self._send(wanted, self._desired_of, stop, BACKGROUND_REGISTER_TIMEOUT_S,
                                                 removed=self.withdrawn)
                    except ContractError as e:
                        if not (self.withdrawn
                                and (e.code, e.field) == (ErrorCode.FAILED_PRECONDITION, "sandbox_classes")):
                            raise
                        # removed by this agent, yet refused as a change of class: a life it did not begin holds
                        # the worker (see `_restamp`); it is removed, and the file's registration begins the next
                        await self._withdraw(f"a registration this agent did not make holds it: {e.message}", stop)
                        # what the file makes now: the send refused may have followed the file past `wanted` (`_send`)
                        wanted = self.desired
                        self._edited = wanted
                        reply = await self._send(wanted, self._desired_of, stop, BACKGROUND_REGISTER_TIMEOUT_S,
                                                 removed=True)
                except ConfigError as e:
                    # Not sent, so not refused: it could not be made on the machine as the probe read it when
                    # its turn came (cpuinfo unreadable for a moment), or its revision could not be kept. It is
                    # not "sent already" (else the registration in force, which the file no longer makes,
                    # stayed for ever): the next read of the file makes it again and sends it; after a state
                    # file it cannot keep a revision in, the next change of the file or of the machine (not
                    # every watch: each would fail alike, and say so)
                    self._edited = None
                    if not isinstance(e, StateFileError):
                        self._read = None
                    raise
                # the file's edit is in force; unless the file was read past MAX_BODY while it was on its way
                self._edit_refused = self._file_too_large is not None
                # or a later one, sent in its stead (`_send`: a new life follows the file): `wanted` was not taken,
                # and the file put back to it sends it
                self._edited = self.registration
            elif registration is AGAIN:
                self._again_waiting = False
                self._again_unmade = None
                try:
                    reply = await self._again(stop)
                except ConfigError as e:
                    # Not sent, so not refused: it could not be made on the machine as the probe read it
                    # (cpuinfo unreadable for a moment). Owed all the same (the server may have lost a
                    # write), so a read of the machine that says otherwise asks for it again (`_look`).
                    # Not when no read changes it (the file names another CPU: `_keep_cpu_true` sees to
                    # that; a state file that cannot keep a revision: an edit's concern)
                    if not isinstance(e, (MachineMismatch, StateFileError)):
                        self._again_unmade = self._machine()[2]
                    raise
            else:
                assert registration == self.desired and self._desired_of is not None  # read at the start
                reply = await self._send(registration, self._desired_of, stop)
        log.info("registered %s: %s (seq %d)", self.worker_id, reply.outcome.value, reply.seq)
        try:
            await self.heartbeat(stop)  # learns the TTL
        except Superseded:
            raise  # this agent stops
        except ContractError as e:
            # The registration stands; a heartbeat refused (by a replica that has not yet seen what
            # the one that took it has: a binding of workers to nodes) is the heartbeats' concern,
            # which carry on, soon (the TTL is not learnt yet), not this registration's refusal,
            # nor a reason to stop at the start.
            log.warning("the heartbeat after registering %s was refused (%s); the heartbeats carry on",
                        self.worker_id, e)
            self._beat_soon = True
        return reply

    async def _again(self, stop: asyncio.Event) -> RegisterReply:
        """`register(AGAIN)`'s registration (see there); the caller holds `_one_registration`."""
        if self._file_too_large is not None:
            # nothing the file makes can be sent: not the registration in force either, which the file no longer
            # makes (a new life under it, once the worker was removed, took placements until the drain after it),
            # as a registry refuses what it cannot take, and nothing is registered
            raise NotRegistrable(str(self._file_too_large), self._file_too_large.refusal)
        reply = None
        refused = False
        if self.desired is not None and self.desired != self.registration:
            try:
                reply = await self._send(self.desired, self._desired_of, stop, BACKGROUND_REGISTER_TIMEOUT_S)
            except ContractError as e:
                if e.code != ErrorCode.FAILED_PRECONDITION:
                    raise
                refused = True
                log.warning("the registry refused what %s says now (%s); registering the registration "
                            "in force again", self.config_path, e.message)
        if reply is None:
            assert self.registration is not None and self._in_force_of is not None  # after the first one
            reply = await self._send(self.registration, self._in_force_of, stop, BACKGROUND_REGISTER_TIMEOUT_S)
            if (refused and reply.outcome is RegisterOutcome.REGISTERED and self.desired is not None
                    and _classes(self.desired) != _classes(self.registration)):
                reply = await self._life_of_the_file(stop)
        return reply

    async def _restamp(self, stop: asyncio.Event) -> RegisterReply | None:
        """`register(RESTAMP)`: the registration in force, made on the machine as the probe reads it
        now (`_send`). If that cannot be made (the probe cannot read a key: ConfigError) for the grace
        (`_unreadable`), or the registry refuses it, the worker is removed (`_withdraw`). A removed
        worker is tried again (`_keep_cpu_true`: at a new reading of the machine, or every
        RESTAMP_AGAIN_S), and begins a new life once the registration is made and taken. None when
        nothing was registered."""
        if not self.withdrawn and not self._cpu_changed_under_registration():
            return None  # made again meanwhile
        if self.withdrawn and self._file_too_large is not None:
            return None  # a new life takes what the file makes, and none can be sent (`_sync_config` said so)
        assert self.registration is not None and self._in_force_of is not None
        read_at = self._machine()[0]
        try:
            reply = await self._send(self.registration, self._in_force_of, stop, BACKGROUND_REGISTER_TIMEOUT_S)
        except ConfigError as e:
            if self.withdrawn:
                return None
            if isinstance(e, (MachineMismatch, StateFileError)):  # certain: no later read changes it
                await self._withdraw(str(e), stop)
                return None
            if not self._unreadable(read_at):  # a passing failure, so far (`_why_stale` may have noted it already)
                log.warning("%s: the probe cannot read this machine (%s); the worker is removed if it still cannot "
                            "%gs after the first such read", self.worker_id, e, self.unreadable_grace_s)
                return None
            await self._withdraw(str(e), stop)
            return None
        except ContractError as e:
            if self.withdrawn:
                if (e.code, e.field) == (ErrorCode.FAILED_PRECONDITION, "sandbox_classes"):
                    # refused as a change of class: the worker has a life this agent did not begin (a copy
                    # of something sent before, decided late; or another sender), with classes, and a CPU,
                    # that are not this machine's as it is: it is removed again
                    await self._withdraw(f"a registration this agent did not make holds it: {e.message}", stop)
                    return None
                log.warning("%s stays removed: the registry refused its registration (%s)", self.worker_id, e)
                return None
            await self._withdraw(f"the registry refused it: {e.message}", stop)
            return None
        if reply.outcome is RegisterOutcome.REGISTERED:
            return await self._life_of_the_restamp(reply, stop)
        return reply

    async def _life_of_the_restamp(self, reply: RegisterReply, stop: asyncio.Event) -> RegisterReply | None:
        """A RESTAMP began a new life (the agent had removed the worker, or another did while it was on its
        way): a new life takes what the file makes, and this one has the registration of the last. Ended
        (the caller holds `_one_registration`) if the file makes one past MAX_BODY, which none takes: the
        worker stays removed until the file is mended (`_restamp`); or begun again with what the file makes
        if its classes differ, or if the registry refused the file's registration to the last life and the file
        makes another than this one (`_life_of_the_file`: an edit refused to the last life, as a change of class
        or for its RuntimeChanged's size, is never sent again on its own, and a registration taken ends a refusal
        for size: the life went on, undrained, with runtimes the file had dropped). None when the worker was
        removed."""
        if self._file_too_large is not None:
            await self._withdraw(str(self._file_too_large), stop, "the registration its agent made again on the "
                                 "CPU the machine has now began a new life, and its file makes one too large to send")
            return None
        assert self.registration is not None and self._in_force_of is not None
        if self.desired is None or self._desired_of is None:
            return reply
        if (_classes(self.desired) != _classes(self.registration)
                or (self._edit_refused and self._desired_of[0] != self._in_force_of[0])):
            return await self._life_of_the_file(stop)
        return reply

    async def _life_of_the_file(self, stop: asyncio.Event) -> RegisterReply:
        """The registration in force, re-sent because the registry refused what the file says,
        began a new life: the worker was removed between the two (by a caller, or as LOST). A
        new life takes what the file says, and this one has the classes of the last, which the
        file may have dropped (a scheduler would send it resumes of a class it no longer runs):
        it is ended, and one begun with what the file says. Only when the file's classes differ
        from this life's (or, after a RESTAMP, the registry refused the file's registration to the last
        life: `_life_of_the_restamp`): any other difference is a registration on the live worker (an edit's,
        after this one). The caller holds `_one_registration`. The removal waits as long as a
        registration beside the heartbeats does before it is asked again: a repeat decided after
        the new registration would end the new life too (request ids count within one life). Taken, the
        file's registration is in force: no edit of it is held as refused any longer."""
        log.warning("%s began a new life with the registration of its last one, not what %s makes; removing it "
                    "and registering again", self.worker_id, self.config_path)
        await self._remove_self("the agent registers anew with what its file makes", stop)
        assert self.desired is not None and self._desired_of is not None
        # it begins a new life (the worker removed just now): it follows the file while it waits, as any such send
        reply = await self._send(self.desired, self._desired_of, stop, BACKGROUND_REGISTER_TIMEOUT_S, removed=True)
        self._edit_refused = self._file_too_large is not None
        return reply

    async def _send(self, registration: RegisterWorker, made_of: MadeOf, stop: asyncio.Event,
                    timeout: float = REQUEST_TIMEOUT_S, removed: bool = False) -> RegisterReply:
        """One registration, sent until answered (again after `timeout` without an answer);
        the caller holds `_one_registration`. `made_of` is what it was made of: if the probe
        reads the machine otherwise now, the same configuration is made again on the machine
        as it is (ConfigError if it cannot be: the probe cannot read it), so no registration
        this agent sends claims a CPU the machine no longer has. `removed`: the worker is out of any life
        this agent began (its caller removed it, `_life_of_the_file`, or sends the file's edit to a worker it
        withdrew), so this send begins a new life, as below."""
        self.sent_registration = self.registering = True
        try:
            sent_again: set[str] = set()
            # What this send takes will begin a new life: its caller says so (`removed`: not a RESTAMP, which
            # sends the registration in force when the file's is refused or cannot be made, `_life_of_the_restamp`),
            # or it removed the worker itself (`Stale`, below)
            while True:
                if removed:
                    # A new life takes what the file makes, when it goes: a registration held back by the budget
                    # is sent as the file's latest (an edit read since it was sent included, else the older one
                    # began the life and the file's was refused to it as a change of class), and none while the
                    # file makes one past MAX_BODY, which cannot be sent (`_again`, `_restamp`)
                    if self._file_too_large is not None:
                        raise NotRegistrable(str(self._file_too_large), self._file_too_large.refusal)
                    if self.desired is not None and self._desired_of is not None and self._desired_of[0] != made_of[0]:
                        registration, made_of = self.desired, self._desired_of
                # Made on the machine as it is, at each send: a registration retried while the registry
                # does not take it (unreachable, or the worker's write budget spent) is made again, with a
                # new request id, once the file makes another registration of the machine as the probe
                # reads it (`Outdated`, `_still_made`), or, once this send removed the worker, another
                # registration at all (`_follows_the_file`).
                config, reading = made_of
                _, machine, now = self._machine()
                if reading != now:
                    registration = self._build(config, machine)
                    made_of = (config, now)
                body = msgspec.structs.replace(registration, request_id=f"agent-{uuid.uuid4().hex}",
                                               revision=self._revision_of(registration))
                try:
                    reply = await self._request("register", body, RegisterReply, stop, timeout=timeout,
                                                stale=self._wait_no_longer,
                                                current=partial(self._still_made, config, now, registration,
                                                                None if not removed else self._follows_the_file))
                    self._in_force_revision = self._beats = body.revision
                    break
                except Outdated as e:
                    # This one may yet be decided (a copy a stalled registry replica holds): whatever is
                    # sent next, the registration in force again included, goes above its revision.
                    self._in_force_revision = None
                    log.warning("registration of %s made again: %s", self.worker_id, e)
                    continue
                except Stale as e:
                    # The registry takes none of this worker's registrations for a while (its write budget
                    # spent), or took none for a TTL, and the one in force claims a CPU the machine no longer
                    # has: the worker is removed meanwhile (a removal is free), where images of that CPU would
                    # be sent. A new life takes what the file makes: once the registry takes it, this
                    # registration, or the file's, if it made another since this one was sent, or makes one while
                    # it waits (sent as it was, the file's was refused to that life when it differed in class).
                    # None while the file makes one past MAX_BODY, which cannot be sent (above)
                    await self._withdraw(str(e), stop)
                    removed = True
                    continue
                except ContractError as e:
                    if (e.code, e.field) == (ErrorCode.INVALID_ARGUMENT, "revision") and "ahead" not in sent_again:
                        # Out of the registry's bound (this clock ran far ahead, and the revision was kept):
                        # none was recorded, so this agent goes back to the last one the registry answered, or
                        # its clock, and tries once more; a clock still that far ahead is refused again.
                        sent_again.add("ahead")
                        log.warning("registration of %s refused (%s); sending it again with the clock's revision",
                                    self.worker_id, e.message)
                        self._revise_back()
                        self._revised = registration
                        continue
                    if (e.code != ErrorCode.FAILED_PRECONDITION or e.field not in ("request_id", "revision")
                            or e.field in sent_again):
                        raise
                    sent_again.add(e.field)
                    # It is the machine as it is now: sent anew, once for each of two reasons.
                    # - request_id: its id crossed a life of the worker while it was sent again (a removal,
                    #   and a life begun since, by a stale copy of an earlier registration): the registry
                    #   refuses an earlier life's id (docs/contract.md). A new id is made above.
                    # - revision: the worker's history holds a higher one, from an earlier process of this
                    #   agent on a clock ahead of this one's: this one goes on above it.
                    if e.field == "revision":
                        self._in_force_revision = None  # a higher one is recorded: go on above it
                        self._revise_above(e)
                    log.warning("registration of %s refused (%s); sending it again with a new %s",
                                self.worker_id, e.message, e.field.replace("_", " "))
        except (ContractError, ConfigError) as e:
            self.registering = False  # refused, or not sent (its revision could not be kept): nothing on its way
            if isinstance(e, ContractError) and too_large(e):
                self._hold_refusal_for_size(e)
            raise
        self.registering = False
        if self._too_large is not None and self._file_too_large is None:
            self._taken_after_too_large(reply)
        elif reply.outcome is RegisterOutcome.REGISTERED:
            self._drained_too_large = False  # a new life, undrained: a drain of an earlier one is no longer had
        previous = None if self.withdrawn else self.registration
        self.registration, self._in_force_of, self.registered = registration, made_of, reply
        self.withdrawn = False
        if previous is not None:
            self._say_dropped(previous, registration, reply)
        self._unreadable_at = None
        return reply

    def _say_dropped(self, previous: RegisterWorker, now: RegisterWorker, reply: RegisterReply) -> None:
        """Say which runtimes (default or restorable) of the registration in force before `now` the
        registry no longer offers, as of the reply's sequence: the one signal an operator dropping a
        runtime has that the log has the drop (docs/operations.md, "Rolling a runtime upgrade"). Until
        then, the registry still places that runtime's images here (an edit not yet sent or answered,
        ignored, or refused leaves the registration in force); from then, only placements made before
        that sequence may still reach the worker with them."""
        after = _runtimes(now)
        names = {named for named, _ in after.values()}
        # a runtime whose name is still offered (the same release made again on another CPU read) is not
        # dropped: its binary stays in use
        gone = [label for key, (named, label) in _runtimes(previous).items()
                if key not in after and (named is None or named not in names)]
        if gone:
            log.info("%s: the registry no longer offers %s as of seq %d; placements made before it may still "
                     "restore them here (`warmboot worker show %s` lists the actors pinned to each)",
                     self.worker_id, ", ".join(gone), reply.seq, self.worker_id)

    def _revision_of(self, registration: RegisterWorker) -> int:
        """The revision `registration` is sent with: the last one given, if to the same content (a
        registration sent again, as after a reconnect, is no newer and writes nothing); else one
        above it and not below this agent's clock, so that a registration this agent sends after
        another is never older, in this process or a later one (a restart; docs/contract.md)."""
        if registration == self._revised:
            return self._revision
        if registration == self.registration and self._in_force_revision is not None:
            # the registration in force, sent again after another the registry refused (a reconnect's
            # AGAIN): it is no newer than when it was answered, and writes nothing
            return self._in_force_revision
        self._revise_next()
        self._revised = registration
        return self._revision

    async def _remove_self(self, reason: str, stop: asyncio.Event) -> None:
        """Remove this worker (the caller holds `_one_registration`), ordered after everything this
        agent sent: its revision is above all of them, refused edits included (which the registry did
        not record), so that a copy of any of them decided late is refused instead of beginning a
        life again (docs/contract.md). Removed already (NOT_FOUND): as good. Then whatever is sent
        next gets a revision of its own. Without a state file that can be written, the removal goes
        without a revision (logged): it still removes."""
        try:
            self._revise_next()
            revision: int | None = self._revision
        except StateFileError as e:
            log.error("%s; removing %s without a revision", e, self.worker_id)
            revision = None
        for attempt in (1, 2, 3):
            body = RemoveWorker(reason=reason, request_id=f"agent-{uuid.uuid4().hex}", revision=revision)
            try:
                await self._request("remove", body, SeqReply, stop, timeout=BACKGROUND_REGISTER_TIMEOUT_S)
                break
            except ContractError as e:
                if e.code == ErrorCode.NOT_FOUND:
                    break
                if attempt == 3 or e.field != "revision" or revision is None:
                    raise
                if e.code == ErrorCode.FAILED_PRECONDITION:
                    self._revise_above(e)
                    revision = self._revision
                else:  # out of the registry's bound (a clock far ahead): removed all the same, without one
                    log.error("%s; removing %s without a revision", e.message, self.worker_id)
                    with suppress(StateFileError):
                        self._revise_back()
                    revision = None
        self._forget_revision()

    def _forget_revision(self) -> None:
        """The worker's life ended (removed, by this agent or as LOST): whatever is sent next, the
        registration in force included, gets a revision of its own. The registry refuses an equal
        revision that would begin a life: a copy of the last registration, decided late, must not
        bring back what ended (docs/contract.md)."""
        self._revised = None
        self._in_force_revision = None

    def _revise_next(self) -> None:
        """A revision above every one this agent gave, and not below its clock."""
        self._revise(max(self._revision + 1, self.clock_ms()))

    def _revise_above(self, refusal: ContractError) -> None:
        """Above the highest a revision refusal names (an earlier process's, on a clock ahead)."""
        self._revise(max(self._revision, latest_revision(refusal) or 0) + 1)

    def _revise_back(self) -> None:
        """Back from a revision the registry refused as out of its bound (none was recorded): to the
        last it answered, or the clock."""
        self._revise(max(self._in_force_revision or 0, self.clock_ms()))

    def _revise(self, revision: int) -> None:
        """Make `revision` the last one, kept in the state file (if any) before anything carries it."""
        if self.state is not None:
            self.state.write(revision)
        self._revision = revision

    def _cpu_changed_under_registration(self) -> bool:
        """Whether the probe reads the machine otherwise than when the registration in force was made."""
        return self._in_force_of is not None and self._in_force_of[1] != self._machine()[2]

    def _why_stale(self) -> str | None:
        """Why the registration in force (the worker registered, not withdrawn) claims a CPU the machine
        no longer has, or None (`_judge_stale`); noting since when it has (`_stale_since`)."""
        why = self._judge_stale()
        undecided = self._unreadable_at is not None  # (a passing failure says nothing: the clock runs on)
        if why is None and not undecided:
            self._stale_since = None
        elif self._stale_since is None:
            self._stale_since = time.monotonic()
        return why

    def _wait_no_longer(self, refused_for_budget: bool, failures: int = 1) -> str | None:
        """Why a registration the registry did not take is not sent again while the worker stays registered,
        or None: the registration in force claims a CPU the machine no longer has (`_why_stale`), and the
        registry refused this one for the worker's write budget (it took nothing, and takes nothing for a
        while), or has taken none for a TTL and at least two attempts of it failed in a row. Not at once
        after a time-out or UNAVAILABLE: the registration may have been taken (a late answer), its retry
        (the same request id) answered from the history, and removing the worker then ends the life it
        registers, and releases its actors. Before the registry's TTL is learnt, the shortest it can be
        (1 s) is waited. Not for ever either: the registry beats a worker at each registration it is
        sent (CONTRACT: a registration counts as a heartbeat), so the attempts themselves would keep the old
        CPU registered for as long as the registry does not decide them."""
        why = self._why_stale()
        if why is None:
            return None
        if refused_for_budget:
            return f"{why}, and the registry takes none of its registrations for now"
        assert self._stale_since is not None
        ttl = self.ttl_s if self._ttl_learnt else MIN_TTL_S
        if failures >= 2 and time.monotonic() - self._stale_since >= ttl:
            return f"{why}, and the registry has taken none of its registrations for {ttl:g}s"
        return None

    def _judge_stale(self) -> str | None:
        """Whether the registration in force claims a CPU the machine no longer has: made on the machine as
        the probe reads it now, it differs, or contradicts what it names literally, or breaks the registry's
        rules (`MachineMismatch`, `NotRegistrable`). A
        read it cannot be made of says nothing of the CPU (cpuinfo unreadable for a moment): only reads
        that fail for the grace do (`_unreadable`), as for `_restamp`."""
        if self.withdrawn or self._in_force_of is None or self.registration is None:
            return None
        read_at, made = self._made_now(*self._in_force_of)
        if isinstance(made, MachineMismatch):
            return str(made)
        if isinstance(made, ConfigError):
            if not self._unreadable(read_at):
                return None
            return f"the probe cannot read this machine twice in a row, for {self.unreadable_grace_s:g}s: {made}"
        self._unreadable_at = None
        return None if made is None or made == self.registration else "the probe reads another CPU"

    def _unreadable(self, read_at: float) -> bool:
        """A read of the machine the probe cannot make a registration of (made at `read_at`): whether it
        ends the grace, failing as every read since the first in a row (`_unreadable_at`, noted here) did,
        on another read than that one and `unreadable_grace_s` after it. A read that can be made ends the
        row (`_judge_stale`, `_keep_cpu_true`, a registration taken)."""
        if self._unreadable_at is None:
            self._unreadable_at = read_at
            return False
        return read_at != self._unreadable_at and read_at - self._unreadable_at >= self.unreadable_grace_s

    def _still_made(self, config: AgentConfig, reading: tuple, registration: RegisterWorker,
                    follows: Callable[[AgentConfig], bool] | None = None) -> bool:
        """Whether `registration`, made of `config` on the read `reading`, is what `config` makes on the
        machine as the probe reads it now (or the probe cannot make anything of it this time); and, with
        `follows`, whether `config` is still what the file makes (`_follows_the_file`)."""
        if follows is not None and not follows(config):
            return False
        made = self._made_now(config, reading)[1]
        if isinstance(made, ConfigError):
            return not isinstance(made, MachineMismatch)
        return made is None or made == registration

    def _follows_the_file(self, config: AgentConfig) -> bool:
        """Whether a registration made of `config`, which will begin a new life (its send removed the worker),
        is still what the file makes as last read: the configuration it was read as (`_desired_of`), and not
        one past MAX_BODY (`_file_too_large`)."""
        return self._file_too_large is None and (self._desired_of is None or self._desired_of[0] == config)

    def _made_now(self, config: AgentConfig, reading: tuple) -> tuple[float, RegisterWorker | ConfigError | None]:
        """(when the machine was last read, what `config` makes of that read): None if the read is
        `reading` still, else the registration, or the ConfigError it cannot be made for."""
        read_at, machine, now = self._machine()
        if now == reading:
            return read_at, None
        try:
            return read_at, self._build(config, machine)
        except ConfigError as e:
            return read_at, e

    async def _withdraw(self, why: str, stop: asyncio.Event, reason: str | None = None) -> None:
        """Remove the worker: its registration claims a CPU the machine no longer has, and `why` says
        why none of the CPU it has now can be made or was taken (or `reason` says why else it must be out
        of service: said, and the removal's reason). The agent then sends no heartbeat,
        and tries again (`RESTAMP` at a new reading of the machine or every RESTAMP_AGAIN_S, from the
        registration it had; and an edit of the file) until a registration is taken: a new life. The
        caller holds `_one_registration`."""
        if reason is None:
            log.error("%s is registered with a CPU this machine no longer has, and no registration of the one it "
                      "has now can be made (%s): removing the worker until one can", self.worker_id, why)
            reason = f"its agent cannot register the CPU its machine has now: {why}"
        else:
            log.error("%s: %s; removing the worker until one can be registered (%s)", self.worker_id, reason, why)
        try:
            await self._remove_self(reason[:256], stop)
        except (ContractError, ConfigError):
            # not removed: withdrawn all the same, so that no heartbeat keeps the worker, and it is LOST
            self.withdrawn = True
            self._edited = None  # and what a later life takes is the file's as it is then, as below
            self._read = None
            raise
        self.withdrawn = True  # `registration` and what it was made of are kept, to be made again
        self._unreadable_at = None
        self._edited = None  # an edit refused to the last life may be what a new life takes
        self._read = None  # so is what the file says now: the next watch sends it if it can be made

    def _register_again(self, stop: asyncio.Event) -> None:
        """`register(AGAIN)` beside the heartbeats, unless one already waits its turn (it will
        be decided after whatever asked for this one)."""
        if not self._again_waiting:
            self._again_waiting = True
            self._beside_heartbeats(AGAIN, "", stop)

    def _beside_heartbeats(self, registration: Latest, refused: str, stop: asyncio.Event) -> None:
        """`register(registration)` in a task of its own, which the heartbeats do not wait for
        (a fleet's registrations at once keep the registry busy for longer than a TTL); a
        refusal is logged after `refused` and the agent keeps serving."""

        async def registering() -> None:
            try:
                await self.register(registration, stop)
            except ConfigError as e:  # the probe cannot read the machine now: nothing was sent, nothing refused
                log.error("nothing sent: %s", e)
            except Superseded:
                pass  # the loop raises it (`superseded`): this agent stops
            except ContractError as e:
                if too_large(e):  # (`register` took it as the refusal: `_too_large`)
                    self._refused_for_size(e, str(e))
                else:
                    log.error("%s%s", refused, e)
                if registration is EDIT:
                    self._edit_refused = True  # until the file says the registration in force again (`_sync_config`)

        task = asyncio.create_task(registering(), name=f"agent-{self.worker_id}-register")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def heartbeat(self, stop: asyncio.Event) -> None:
        """A beat, unless the worker was removed on purpose (a beat would be NOT_FOUND, and register
        again what is wrong), or its registration in force claims a CPU the machine no longer has
        (`_why_stale`, on a read of the machine made for this beat): that one is kept alive by no beat
        while it is made again (`RESTAMP`, asked at once, or an edit); should the registry take none
        within a TTL, the agent removes the worker (`_wait_no_longer`), or the registry does, as LOST."""
        if self.withdrawn:
            return
        self._machine(fresh=True)  # a beat says the worker is as registered: of the machine as it is now
        if self._not_beating(self._why_stale()):
            self._look(stop)  # made again at once, not at the next watch
            return
        if not await self._out_of_placement():
            return
        beats = self._beats
        try:
            reply = await self._request("heartbeat", Heartbeat(revision=beats), HeartbeatReply,
                                        stop, current=lambda: self._why_stale() is None)
        except Outdated:
            self._not_beating(self._why_stale() or "the probe reads another CPU")
            return
        except ContractError as e:
            if (e.code, e.field) == (ErrorCode.FAILED_PRECONDITION, "revision") and self.registration is not None:
                # Another agent of this worker id registered it since (a twin, or the machine's
                # replacement): this one stops. Registering again, each would take the worker
                # from the other at each of their beats, fencing its placements every time, for ever.
                superseded = superseded_by(e, self.worker_id, self.node, self._revision)
                if superseded is not None:
                    self.superseded = superseded
                    self._superseding.set()
                    raise superseded
                # The registration in force is not this agent's: another agent registered the worker id
                # since (two machines run as one), whose CPU this machine may not have. Not when one of
                # this agent's is on its way or was answered meanwhile (the beat crossed it: the next
                # beat names it). Once for each registration of this agent's: a registration is a beat
                # (CONTRACT), a refused one too (the other's classes: a change of class), and one sent at
                # each refused beat would keep the other's registration alive for ever; the beats go on
                # naming this agent's and keep nothing alive, and the worker is removed as LOST, then
                # registered anew (a NOT_FOUND).
                if not self.registering and self._beats == beats:
                    if self._beats_refused == beats:
                        log.warning("%s: %s; its registration again was not taken: the beats keep nothing alive "
                                    "until the registry removes the worker (LOST), then it registers anew",
                                    self.worker_id, e.message)
                        return
                    log.warning("%s: %s; registering this machine again", self.worker_id, e.message)
                    self._beats_refused = beats
                    self._forget_revision()  # above the other's revision (`_revise_above` if refused)
                    self._register_again(stop)
                return
            if e.code != ErrorCode.NOT_FOUND or self.registration is None:
                raise
            # Registered anew beside the heartbeats (with what the file and the probe say then: a
            # new life takes up a change the last one was refused), behind any registration on its
            # way: one waiting here would hold this loop, heartbeats included.
            log.warning("the registry no longer knows %s (%s); registering again", self.worker_id, e.message)
            self._forget_revision()
            self._register_again(stop)
            return
        self.ttl_s, self._ttl_learnt = reply.ttl_s, True
        if drain_to_say(reply.drained, self._drain_known):
            self._drain_known = reply.drained.seq
            log.warning("%s", said_drained(self.worker_id, reply.drained))

    async def _out_of_placement(self) -> bool:
        """Whether a beat may go out, after this agent's registration was refused for its size (`_too_large`):
        only once the worker is drained. The registration in force is then not
        what the file and the probe make (an edit, a rolling upgrade: runtimes the machine may no longer
        run), and the registration the file makes is refused again each time it is sent (its body, or an
        event it writes, past what NATS carries: a RuntimeChanged carries the previous classes too). Beaten as it is, it drew resumes for runtimes
        this machine may not load for as long as the agent ran; drained, it takes no placements, and its
        running actors stay (pinned to the runtimes they run under). A drain not had (the registry does
        not answer) holds the beat back, and is asked again at the next one: the worker is drained, or
        removed as LOST, and then registered anew with what the file says (a NOT_FOUND). The worker stays
        drained for the rest of its life, also once a registration that fits is taken (a drain is not
        undone: docs/contract.md, "A registration too large for one event")."""
        refusal = self._too_large
        if refusal is None or self._drained_too_large:
            return True
        reason = "its agent's registration was refused as too large; the runtimes in force are not what its " \
                 "configuration says"
        body = DrainWorker(reason=reason, request_id=f"agent-{uuid.uuid4().hex}", revision=self._beats)
        try:
            reply = await self._request("drain", body, SeqReply, None)
        except ContractError as e:
            if e.code is ErrorCode.NOT_FOUND:  # in no life: out of placement already; the beat registers anew
                # Held as had (until a registration is taken: `_taken_after_too_large`), the refusal kept: cleared,
                # the next refusal of the registration (a new life's WorkerRegistered too large) counted as a first
                # one and asked for a beat at once (`_beat_soon`), and the agent sent a drain, a beat and a
                # registration of up to a megabyte about every 0.2 s, where it sends one each beat.
                self._drained_too_large = self._too_large is refusal
                return True
            if (e.code, e.field) == (ErrorCode.FAILED_PRECONDITION, "revision"):
                return True  # another registration is in force: the beat's refusal decides (`heartbeat`)
            failure = str(e)
        except Exception as e:  # no answer, or the connection is down
            failure = describe_error(e)
        else:
            # (of this refusal's life: a registration taken meanwhile may have begun another, `_taken_after_too_large`)
            self._drained_too_large = self._too_large is refusal
            self._drain_known = max(self._drain_known, reply.seq)  # said here: no beat says it again
            log.error("%s drained (seq %d): its registration was refused for its size (%s). The registration in "
                      "force, which %s no longer makes, takes no placements; its running actors stay. Make the "
                      "file's runtimes fit, then, once its actors are moved, `warmboot worker remove %s`: the "
                      "agent registers it anew, undrained", self.worker_id, reply.seq, refusal, self.config_path,
                      self.worker_id)
            return True
        log.error("%s: no heartbeat until it is drained (%s): its registration was refused for its size (%s), and "
                  "the registration in force, which %s no longer makes, must take no placements", self.worker_id,
                  failure, refusal, self.config_path)
        return False

    def _hold_refusal_for_size(self, refusal: ContractError) -> None:
        """The registration the file makes refused for its size (by the registry, the client, or the agent
        itself: past MAX_BODY): the worker drained at the next beat, within a second or so (`_out_of_placement`),
        unless a refusal is had already."""
        if self._too_large is None:
            self._too_large = refusal
            self._beat_soon = True

    def _refused_for_size(self, refusal: ContractError, said: str) -> None:
        """`_hold_refusal_for_size`, said (`said`: the refusal, naming the file where the agent refused it)."""
        self._hold_refusal_for_size(refusal)
        log.error("the registration %s makes was refused as too large; the worker is drained before its next beat, "
                  "if it is in a life: %s", self.config_path, said)

    def _taken_after_too_large(self, reply: RegisterReply) -> None:
        """A registration taken after one refused for its size: the refusal is over. A new
        life is undrained; in the same life the worker stays drained, if it was, and the agent says so."""
        drained, self._too_large, self._drained_too_large = self._drained_too_large, None, False
        if drained and reply.outcome is not RegisterOutcome.REGISTERED:
            log.warning("%s: the registry took its registration (%s, seq %d); the worker stays drained in this "
                        "life (drained when a registration was refused as too large): once its actors are moved, "
                        "`warmboot worker remove %s`, and the agent registers it anew, undrained", self.worker_id,
                        reply.outcome.value, reply.seq, self.worker_id)

    def _not_beating(self, why: str | None) -> bool:
        """Whether a beat is held back for `why` (said)."""
        if why is not None:
            log.warning("no heartbeat for %s: %s; none until it is registered again on the machine as it is "
                        "(else the registry removes it as LOST)", self.worker_id, why)
        return why is not None

    async def drain(self, reason: str, timeout_s: float = 5.0) -> SeqReply | None:
        """Best effort at exit: a drain retried for at most `timeout_s`; also while the worker is
        not found, if a registration was on its way (another replica may store it after). It names the
        registration its beats keep, or, refused for one of this agent's own it has not heard answered, that one."""
        give_up = asyncio.Event()
        # the registration its beats keep (a replacement's, registered since, is refused: docs/registry.md); before
        # any answer was heard, the last it made (else it named none, and drained another node's registration)
        revision = self._beats if self._beats is not None else (self._revision or None)
        body = DrainWorker(reason=reason, request_id=f"agent-{uuid.uuid4().hex}", revision=revision)
        waiting = (ErrorCode.NOT_FOUND,) if self.registering else ()

        async def drained() -> SeqReply:
            nonlocal body
            while True:
                try:
                    return await self._request("drain", body, SeqReply, give_up, waiting)
                except ContractError as e:
                    # Refused for another registration in force: one of this agent's own, stored but not heard
                    # of (on its way when it stopped, or again after a refused beat), is this machine's (its
                    # node, a revision it made) and drained; another agent's (another node, or above every
                    # revision this agent made: a replacement on this node) is not.
                    named = in_force_named(e)
                    if named is None or named[0] == body.revision or named[1] != self.node or named[0] > self._revision:
                        raise
                    body = msgspec.structs.replace(body, revision=named[0])

        try:
            reply = await asyncio.wait_for(drained(), timeout_s)
        except asyncio.TimeoutError:  # (no text of its own: the log said nothing of why)
            log.warning("could not drain %s: no answer within %.1fs (NATS at %s frozen or unreachable, or no registry "
                        "replica serving); given up: the worker stays as it was, or is drained if the request "
                        "reaches a replica later", self.worker_id, timeout_s, redact_url(self.nats_url))
            return None
        except (asyncio.CancelledError, ContractError) as e:
            log.warning("could not drain %s: %s", self.worker_id, e)
            return None
        self._drain_known = max(self._drain_known, reply.seq)  # said by its caller: no beat says it again
        return reply

    async def _superseded_now(self, timeout_s: float = 2.0) -> Superseded | None:
        """Before the drain at exit: a beat naming this agent's registration, and Superseded (said) if the
        registry refuses it for another agent's registration above every one this agent made
        (`superseded_by`). An agent stopped before its next beat (a replacement started before it, as a
        rolling update does) drained the worker the other holds, its registration drained for the rest of
        its life and its agent never told. Best effort, as the drain: one attempt, None when it is not
        answered within `timeout_s`, or refused otherwise (then the drain is sent, as before). A
        registration taken between this beat and the drain is not drained: the drain names the
        registration this agent's beats keep (`DrainWorker.revision`), and the registry refuses it."""
        if self._beats is None:
            return None
        answer = await self._beat_once(self._beats, timeout_s)
        if not isinstance(answer, ContractError) or (answer.code, answer.field) != (ErrorCode.FAILED_PRECONDITION,
                                                                                    "revision"):
            return None
        superseded = superseded_by(answer, self.worker_id, self.node, self._revision)
        if superseded is not None:
            log.warning("not draining %s on the way out: %s", self.worker_id, superseded.message)
        return superseded

    async def _beat_once(self, revision: int, within_s: float, stop: asyncio.Event | None = None
                         ) -> HeartbeatReply | ContractError | None:
        """A heartbeat naming `revision`, asked again while unanswered for at most `within_s`: its answer,
        its refusal, or None when it got neither (what the checks of a stop as superseded judge: at the
        exit, `_superseded_now`; at the start, `_check_still_superseded`)."""
        try:
            return await asyncio.wait_for(self._request("heartbeat", Heartbeat(revision=revision), HeartbeatReply,
                                                        stop, timeout=min(within_s, REQUEST_TIMEOUT_S)), within_s)
        except ContractError as e:
            return e
        except (asyncio.TimeoutError, nats.errors.Error, OSError):
            return None

    async def _check_still_superseded(self, stop: asyncio.Event) -> None:
        """At the start of an agent that stopped as Superseded (its record says so), before any
        registration: a beat naming its last revision made, and StillSuperseded (raised: it does not
        register) if the registry refuses it for another agent's registration above that one
        (`still_superseded`). Otherwise the record is cleared and the agent registers, as it does without
        one: also when the registry does not answer within START_CHECK_S (asked again meanwhile)."""
        if self.superseded_record is None or self._was_superseded is None:
            return
        # (a record without a revision kept: none made, so none of its own is in force)
        answer = await self._beat_once(self._revision, START_CHECK_S, stop) if self._revision else None
        decided = still_superseded(answer, self.worker_id, self.node, self._revision, self.superseded_record.path,
                                   self._was_superseded)
        if isinstance(decided, StillSuperseded):
            self.superseded = decided
            raise decided
        recorded, self._was_superseded = self._was_superseded, None
        self.superseded_record.clear()
        log.info("%s: this agent stopped for node %s's registration (revision %d) before; %s: registering",
                 self.worker_id, *recorded, decided)

    # --- the loop --------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set. A configuration or registration the registry
        refuses at start raises (ConfigError, ContractError); later ones are logged. Raises
        Superseded, whenever, once another agent of this worker id holds it. With a state file, holds it
        while it runs (StateFileError at once, before anything is sent, if another agent does)."""
        if self.state is None:
            await self._run(stop)
            return
        held = self.state.hold()
        try:
            # read again under the lock: an agent that held it until now may have written since this one read
            self._revision = max(self._revision, self.state.read())
            if self.superseded_record is not None:
                self._was_superseded = self.superseded_record.read()
            await self._run(stop)
        finally:
            held.close()

    async def _run(self, stop: asyncio.Event) -> None:
        registration = self._read_config()
        assert registration is not None
        nc = await self._connect(stop)
        if nc is None:
            return  # stopped before the server answered
        self.nc = nc
        serving = asyncio.create_task(self._serve(registration, stop), name=f"agent-{self.worker_id}")
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if serving.done():
                serving.result()  # its error is the caller's (the CLI says it), not logged here too
        finally:
            asks_end = time.monotonic() + EXIT_ASKS_S  # the serving tasks' end, the check and the drain, together

            def left(most: float = EXIT_ASKS_S) -> float:
                return min(most, max(EXIT_ASK_LEAST_S, asks_end - time.monotonic()))

            await cancel_and_wait(stopping, None if serving.done() else serving)
            if (self.drain_on_exit and self.sent_registration and not self.withdrawn and self.superseded is None
                    and not self.nc.is_closed):  # (superseded: the worker is another agent's, not this one's to drain)
                # asked first: stopped before its next beat, it may not have heard that another took the worker
                self.superseded = await self._superseded_now(left(2.0))
            if (self.drain_on_exit and self.sent_registration and not self.withdrawn and self.superseded is None
                    and not self.nc.is_closed):
                reply = await self.drain("agent stopped", left())
                if reply is not None:
                    log.info("drained %s (seq %d)%s", self.worker_id, reply.seq,
                             "; it already was" if reply.unchanged else "")
            if self.superseded is not None:
                self._record_superseded(self.superseded)
            with suppress(Exception):
                await close_within(self.nc)  # its server gone too, or frozen (nats-py's own close never ends then)

    def _record_superseded(self, superseded: Superseded) -> None:
        """Keep beside the state file that this agent stopped as Superseded (`SupersededRecord`), for its
        next process to check at its start rather than take the worker back. Without a state file nothing
        is kept: a supervisor that restarts the agent has it take the worker back (docs/registry.md). A
        record that cannot be written is said, and the agent stops all the same."""
        if self.superseded_record is None:
            return
        try:
            self.superseded_record.write(superseded.node, superseded.revision)
        except StateFileError as e:
            log.error("%s; its next start registers, taking the worker back", e)

    async def _serve(self, registration: RegisterWorker, stop: asyncio.Event) -> None:
        try:
            await self._beat_and_watch(registration, stop)
        finally:
            if self._background:
                await cancel_and_wait(*self._background)

    async def _beat_and_watch(self, registration: RegisterWorker, stop: asyncio.Event) -> None:
        await self._check_still_superseded(stop)
        await self.register(registration, stop)
        next_beat = time.monotonic() + self.ttl_s / HEARTBEATS_PER_TTL
        next_watch = time.monotonic() + self.watch_interval_s
        while True:
            await _wait_any((stop, self._reconnected, self._superseding), min(next_beat, next_watch) - time.monotonic())
            if stop.is_set():
                return
            if self.superseded is not None:  # refused in a beat after a registration beside the heartbeats
                raise self.superseded
            if self._beat_soon:  # a heartbeat refused before the TTL was learnt: the next one soon
                self._beat_soon = False
                next_beat = min(next_beat, time.monotonic() + RETRY_MIN_S)
            try:
                if self._reconnected.is_set():
                    # A heartbeat at once (the worker's TTL runs again from now), and beside it the
                    # registration in force again, in a task of its own that the heartbeats do not
                    # wait for: when a whole fleet comes back at once, the registry takes tens of
                    # seconds to answer every registration.
                    self._reconnected.clear()
                    self._register_again(stop)
                    await self.heartbeat(stop)
                    next_beat = time.monotonic() + self.ttl_s / HEARTBEATS_PER_TTL
                if time.monotonic() >= next_watch:
                    self._look(stop)
                    next_watch = time.monotonic() + self.watch_interval_s
                if time.monotonic() >= next_beat:
                    await self.heartbeat(stop)
                    next_beat = time.monotonic() + self.ttl_s / HEARTBEATS_PER_TTL
            except Superseded:
                raise  # another agent holds the worker: this one stops
            except ContractError as e:  # the registry refused something: say so, keep serving
                log.error("%s", e)
                next_beat = time.monotonic() + RETRY_MAX_S

    def _look(self, stop: asyncio.Event) -> None:
        """What the watch does, and a heartbeat that reads another CPU: an edit of the file, or a change
        of what the probe reads, registered beside the heartbeats (`_sync_config`), else the registration
        in force made again on the machine as it is (`_keep_cpu_true`); and a registration after a
        reconnect that could not be made of an earlier read of the machine (`_again_unmade`)."""
        self._sync_config(stop)
        self._keep_cpu_true(stop)
        if self._again_unmade is not None and self._machine()[2] != self._again_unmade:
            self._again_unmade = None  # a registration after a reconnect not made then: on this read
            self._register_again(stop)

    def _keep_cpu_true(self, stop: asyncio.Event) -> None:
        """The registration in force made again on the machine as it is now (`RESTAMP`), when the
        probe reads it otherwise and nothing on its way says so (an edit waiting, or any
        registration being sent: each is made on the machine as it is then), or when the worker
        was removed for want of one (`withdrawn`); at most once per read of the machine, and once
        every RESTAMP_AGAIN_S while the machine reads the same, and looked at again at the next
        watch if something was on its way."""
        read_at, _, reading = self._machine()
        if not self.withdrawn and not self._cpu_changed_under_registration():
            self._unreadable_at = None  # the machine reads as registered: a failed read before was passing
            self._restamp_asked = None  # and the next change is a new one
            return
        asked = self._restamp_asked
        same_read = asked is not None and asked[0] == read_at
        if same_read or (asked is not None and asked[1] == reading and read_at - asked[0] < RESTAMP_AGAIN_S):
            return
        if self._edit_waiting or self._restamp_waiting or self._one_registration.locked():
            return
        self._restamp_asked = (read_at, reading)
        self._restamp_waiting = True
        self._beside_heartbeats(RESTAMP, "", stop)

    def _sync_config(self, stop: asyncio.Event) -> None:
        """An edit of the file (or a change of what the probe reads) registered beside the
        heartbeats: a fleet's agents edited at once (a rollout) register at once."""
        try:
            registration = self._read_config()
        except ConfigError as e:
            self._config_failed = True
            # (e names the file first, and the field: `FILE: capacity.cpu_millis: ...`)
            if isinstance(e, NotRegistrable) and too_large(e.refusal):
                # an edit, or a new reading of the machine (the same file made on it), or a read after the worker
                # was removed (`withdrawn`: none is sent while it reads so, `_restamp`)
                self._refused_for_size(e.refusal, str(e))
                self._edit_refused = True  # until the file says the registration in force again (below)
                self._file_too_large = e
                return
            # another error (a typo made since, the probe unable to read the machine) keeps `_file_too_large`: what
            # the file makes is not known to fit, and the registration in force is still not what it makes
            if self.edited:  # (none is in force once the worker was removed for want of one: said so)
                kept = "the worker stays removed until one can be made" if self.withdrawn else \
                    "keeping the registration in force"
                log.error("ignoring the edit of %s; %s", e, kept)
            else:
                log.error("what the probe reads of this machine changed, and no registration can be made of it: %s",
                          e)
            return
        if registration is None:
            return  # nothing new
        refused_by_agent, self._file_too_large = self._file_too_large is not None, None
        if refused_by_agent and self.withdrawn:
            self._restamp_asked = None  # a RESTAMP held back for the file (`_restamp`) is asked at once, not in 10 s
        if self._config_failed:  # the error said, the mend is said too: it may change nothing
            self._config_failed = False
            log.info("%s reads again without error%s", self.config_path,
                     "; it makes the registration in force" if registration == self.registration else "")
        if self._edit_waiting:
            return  # the edit waiting its turn will send what is read last
        if registration == self.registration and self._edit_refused and not self._one_registration.locked():
            # the file put back after an edit refused (logged as an error): said too, as a mend is, and that edit
            # is no longer held as sent, so that making it again sends it again (a user trial: the error was the
            # last word, and the same edit made again later was not sent)
            refuser = "the agent" if refused_by_agent else "the registry"
            self._edited, self._edit_refused = None, False
            self._too_large = None  # what the file says is in force: beaten again
            log.info("%s makes the registration in force again; the edit %s refused is given up", self.config_path,
                     refuser)
        if registration == self.registration and not self._one_registration.locked():
            return
        self._edit_waiting = True
        self._beside_heartbeats(EDIT, f"the registry refused the edit of {self.config_path}, "
                                      "keeping the registration in force: ", stop)


def next_delay(previous: float, left: float | None = None, ttl_s: float | None = None) -> float:
    """The wait before the next attempt of a request the registry did not answer: twice the
    last, at most RETRY_MAX_S; and while the TTL of the worker's last stored beat has `left`
    seconds to run, at most a third of them (at least RETRY_MIN_S), so that attempts come
    closer together as it runs out and one lands soon after the registry is back. Once it has
    run out, at most a third of the TTL (`ttl_s`, the beats' own interval): a registry back after
    an outage gives the worker a new clock of one TTL (`services.registry.liveness.Hearing`),
    which one attempt in RETRY_MAX_S could miss where the TTL is shorter."""
    delay = min(previous * 2, RETRY_MAX_S)
    if left is not None and left > 0:
        delay = min(delay, max(RETRY_MIN_S, left / 3))
    elif left is not None and ttl_s is not None:
        delay = min(delay, max(RETRY_MIN_S, ttl_s / 3))
    return delay


async def _wait(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to `timeout` seconds for `event`; True if it is set."""
    with suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), max(timeout, 0))
    return event.is_set()


async def _wait_any(events: tuple[asyncio.Event, ...], timeout: float) -> bool:
    """Wait up to `timeout` seconds for any of `events`; True if one is set."""
    if any(e.is_set() for e in events):
        return True
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        done, _ = await asyncio.wait(waiters, timeout=max(timeout, 0), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
    return bool(done)

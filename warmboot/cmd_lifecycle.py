"""Lifecycle commands: `warmboot actor ...` (`warmboot worker ...` is warmboot.cmd_worker's, on the parts
both share here: `run`, `each_one` for several ids, `echo`, the request-id option).

Each mutating command is one call of `warmboot.client.Client`, after, for the verbs that name
the actor's placement or life, one `snapshotter.status` question (below) (request id generated
unless `--request-id` is given, so running the same command again with the same id
is the same request; UNAVAILABLE and time-outs retried), printed as one line for
people or, with `--json` (or `-o json`), as the reply's JSON. A contract error is printed as
`error: CODE field: message` on stderr with exit status 1 (warmboot.cli_common.Failed).

`actor show` reads the actor's own history (`<prefix>.ev.actor.<id>`) and folds it with
the scheduler's projection: state, spec, latest snapshot and its stamp, assignment; the
runtime labels are a scheduler's (`scheduler.runtimes`), or, when none answers, the
workers' histories folded.

`actor pause` and `actor suspend` ask the snapshotter where the actor is now
(`snapshotter.status`) before their request, for the placement they name, unless
`--placement-seq` is given (through the client's fence, `warmboot.client.Client._placement_of`);
`actor resume`, `stop`, `tag`, `revert` and `update-template`, for the life they name, unless
`--life-seq` is given (`life_now`).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import click
import msgspec
import nats.errors

from events.codec import decode_request, encode, json_path, to_builtins, unknown_fields
from events.errors import ContractError, no_actor
from events.compat import compat_key
from events.runtime_id import Runtimes, short_id
from events.schema import (ActorCreated, ActorRuntime, Assignment, ClassFragmentation, CreateActor, ErrorCode,
                           Explanation, Fidelity, Fragmentation, PauseActor, Resources, ResumeActor, RevertActor,
                           Snapshot, StopActor, StreamSeq, SuspendActor, TagRecorded, TagSnapshot, UpdateTemplate)
from events.schema import ACTORS_LIMIT_MAX, CLASS_PATTERN, ActorPage, ActorsQuery, ActorSummary  # actor list
from events.states import ActorState
from events.subjects import event_subject
from warmboot.cli_common import (MIB, MILLICORES, REFUSED_THE_LOG, Failed, IntRange, LogUnreadable, OneOrMore,
                                 ask, check_id, flag_of, json_option, last_seq, min_seq_option, nats_option,
                                 prefix_option, read_subject, request_field, selectors_of, unread_why, wire_bounds)
from warmboot.client import (UNDER_PLACEMENT, Client, NobodyAnswered, Refused, asked_first, below_memory,
                             placed_under)
from services.scheduler.feasibility import RUNTIME_MISMATCH, SELECTOR_MISMATCH
from services.scheduler.feasibility import none_passes as feasibility_none_passes
from warmboot.cmd_views import (
    LABELS_TIMEOUT_S,
    cut_short,
    listing_limit,
    paging_options,
    with_runtime_ids,
    Walked,
    walk_listing,
    asked_runtimes,
    decision_fields,
    echo_json,
    echo_table,
    fleet,
    fleet_runtimes,
    folded_pages,
    millis,
    mib,
    named_few,
    output_mode,
    output_option,
    pin_label,
    runtime_labels,
    runtimes_of,
)
from warmboot.render import Column, JsonList, cell_columns, key_values, render_fields, render_table, terminal_width

T = TypeVar("T")


def one_state(value: str | None) -> str | None:
    """--state in any case, as the views print it (upper case), or a usage error listing them so."""
    if value is None:
        return None
    states = [s.value for s in ActorState]
    if value.upper() not in states:
        raise click.BadParameter(f"{value!r} is not one of {', '.join(states)}")
    return value.upper()

placement_seq_option = click.option(
    "--placement-seq", type=IntRange(*wire_bounds(StreamSeq)), default=None, metavar="SEQ",
    help="The seq `actor resume` printed for the placement the image was taken under: refused, and nothing "
         "recorded, if the actor has been placed anew since (its worker removed meanwhile, say). Default: "
         "the placement the snapshotter says the actor has when the command starts (none, with a note, if the "
         "snapshotter is of an earlier version).")


placement_file_option = click.option(
    "--placement", "placement_file", type=click.File("rb"), default=None, metavar="FILE",
    help="The Assignment the image was taken under, as `actor resume -o json` printed it ('-': standard input): "
         "names its seq, worker, node and pin, so that a log rolled back past that placement and written again refuses "
         "the request instead of recording the image under the other placement's pin (docs/operations.md). "
         "Instead of --placement-seq.")


def check_create_body(body: CreateActor, golden: Path | None) -> None:
    """The create as the snapshotter decodes it (`decode_request`: `events.validate.check_create`, the
    rules across its fields: --source-tag or --golden-snapshot, not both; a golden snapshot EXTERNAL, on no
    node, with a uri, stamped with --class's runtime if at all, its stamp's version valid), else a usage
    error naming the option that gave the field (`flag_of`), exit status 2, before anything is sent (it
    was refused once the snapshotter answered, exit 1); a field of the file is said as the file's own
    (`file_body`: `FILE at $.location: ...`)."""
    try:
        decode_request(CreateActor, encode(body))
    except ContractError as e:
        flag = flag_of(e.field)
        inner = (e.field or "").partition("golden_snapshot.")[2]
        said = f"{golden} at {json_path(inner)}: {e.message}" if golden is not None and inner else e.message
        if flag is None:  # a field no option gives (each is checked as it is given): said as the service says it
            raise click.UsageError(f"{e.field}: {said}" if e.field else said) from None
        raise click.BadParameter(said, param_hint=f"'{flag}'") from None


def file_body(type_: type[T], data: bytes, where: str, option: str) -> T:
    """The body of `type_` a file given to `option` holds, decoded and checked as the service will check
    it; a usage error naming the option, the file and the field's JSON path otherwise."""
    try:
        return decode_request(type_, data)
    except ContractError as e:
        raise click.BadParameter(f"{where} at {json_path(e.field)}: {e.message}", param_hint=f"'{option}'") from None


def placement_named(actor_id: str, placement_seq: int | None, placement_file: Any,
                    request: type = PauseActor) -> Assignment | None:
    """The Assignment `--placement FILE` holds, checked: a usage error naming the option for a file
    that is not one, one of another actor, or beside --placement-seq; or one whose placement the
    `request` (a pause or suspend) would name as the snapshotter refuses it (`placed_under`, decoded as
    the snapshotter decodes the request: `events.validate.check_under_placement`; a seq of 0, a pin's
    version without the keys its schema version requires), the file's field named, before anything is
    sent."""
    if placement_file is None:
        return None
    if placement_seq is not None:
        raise click.UsageError("give --placement or --placement-seq, not both (the file names its seq)")
    where = getattr(placement_file, "name", "-")
    placed = file_body(Assignment, placement_file.read(), where, "--placement")  # (as printed: runtime ids beside)
    if placed.actor_id != actor_id:
        raise click.BadParameter(f"{where} is an Assignment of actor {placed.actor_id}, not {actor_id}",
                                 param_hint="'--placement'")
    try:
        decode_request(request, encode({**REQUIRED.get(request, {}), **msgspec.structs.asdict(placed_under(placed))}))
    except ContractError as e:
        first, dot, rest = (e.field or "").partition(".")
        raise click.BadParameter(f"{where} at {json_path(UNDER_PLACEMENT.get(first, first) + dot + rest)}: {e.message}",
                                 param_hint="'--placement'") from None
    return placed


life_seq_option = click.option(
    "--life-seq", type=IntRange(*wire_bounds(StreamSeq)), default=None, metavar="SEQ",
    help="A seq of the actor's life this request is for (what `actor create` or `actor resume` printed): "
         "refused, and nothing done, if the actor has been created anew since. Default: the life the "
         "snapshotter says the actor is in when the command starts (none, with a note, if the snapshotter is of "
         "an earlier version, or, for a resume, does not say).")


async def life_now(wb: Client, actor_id: str, given: int | None, *, resume: bool = False,
                   note: Callable[[str], None] | None = None) -> int | None:
    """What a resume, stop, tag, revert or update-template from the CLI names as the actor's life
    (`life_seq`) when the command gives none: the creation of the life the snapshotter says the actor
    is in (`Client.status`). A copy of the command held in a NATS server's buffers, its caller gone,
    and decided once the actor was stopped and created anew, is then refused, FAILED_PRECONDITION
    field `life_seq`, instead of acting on a life nobody asked it of (placing it, stopping it, ...).

    The snapshotter's own verbs go without one only where the client's pause does
    (`Client.status_if_served`: a snapshotter of an earlier version, which ignores it anyway), and a
    line on stderr says so; any other failure of the question fails the command, nothing sent (the
    request would go to the snapshotter that did not answer). A resume, which the scheduler carries
    out, goes without one whenever the snapshotter does not say (UNAVAILABLE: down, of an earlier
    version, its history of the actor holding an event it cannot read), and says so: a late copy of it
    places a life nobody asked for on a worker its image loads on, which is no reason to refuse a
    resume the scheduler can place (`note` is told the line, else it goes to stderr). Any other refusal
    (NOT_FOUND, as the scheduler would say; credentials that may not ask) fails the command."""
    if given is not None:
        return given
    if not resume:
        wb.on_unfenced = unfenced_note("life", "--life-seq", "created")
        now = await wb.status_if_served(actor_id)
        return None if now is None else now.life_seq
    try:
        return (await wb.status(actor_id)).life_seq
    except Refused as e:
        raise asked_first(e, actor_id, "life") from None
    except ContractError as e:
        if e.code is not ErrorCode.UNAVAILABLE:  # NOT_FOUND, as the scheduler would say; refused credentials
            raise
        line = (f"note: {unfenced_text('life', '--life-seq', 'created')}: the snapshotter did not say which life "
                f"the actor is in ({e.code.value}: {e.message})")
        (note or (lambda text: click.echo(text, err=True)))(line)
        return None


def unfenced_text(what: str, option: str, anew: str) -> str:
    return (f"not fenced to the actor's {what} (give {option}: a copy of this request decided after the actor is "
            f"{anew} anew is then refused, not carried out)")


def unfenced_note(what: str, option: str, anew: str) -> Callable[[str, ContractError], None]:
    """What a command says when its client sends it without the fence it would name (`Client(on_unfenced=)`):
    the snapshotter is of an earlier version, with no `status` (which ignores the fence anyway)."""
    def note(actor_id: str, error: ContractError) -> None:
        click.echo(f"note: {unfenced_text(what, option, anew)}: the snapshotter lists no status endpoint (an "
                   "earlier version)", err=True)
    return note


# The required fields of the requests whose other fields an option gives (`request_field`): any valid value,
# for the option's value to be decoded as the service decodes the request.
REQUIRED: dict[type, dict[str, Any]] = {
    CreateActor: {"actor_id": "a", "sandbox_class": "c", "template_uid": "t",
                  "resources": {"cpu_millis": 1, "memory_mib": 1}},
    SuspendActor: {"fidelity": Fidelity.MEMORY.value},
    TagSnapshot: {"tag": "t"},
    UpdateTemplate: {"template_uid": "t"},
}


def field_of(request: type, field: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """`request_field` of a request this module sends, its other required fields given (`REQUIRED`)."""
    return request_field(request, field, **REQUIRED.get(request, {}))


def check_request_id(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """click callback: `--request-id ''` is a usage error. The client takes an empty id for none and makes a
    new one, so `actor pause A --request-id "$ID"` with $ID empty was a new request at each run, not the
    same one sent again, without a word (and `actor create`'s, sent as given, INVALID_ARGUMENT: a user
    trial); the rest of the id's form is the service's to judge, naming the option."""
    if value == "":
        raise click.BadParameter("an empty request id: give the id of the request to send again, or leave the "
                                 "option out for a new one")
    return value


def request_id_option(request: type) -> Callable[[Callable], Callable]:
    """`--request-id` of a command that sends a request of type `request`: not empty (`check_request_id`),
    and what the service takes as the request's `request_id` (`request_field`: at most 128 printable
    characters), else a usage error naming it, before anything is sent."""
    field = field_of(request, "request_id")
    return click.option("--request-id", default=None,
                        callback=lambda ctx, param, value: field(ctx, param, check_request_id(ctx, param, value)),
                        help="Idempotency key, at most 128 printable characters: the same command with the same id "
                             "is the same request (default: a new one, named by an UNAVAILABLE error: the request "
                             "may have been carried out).")


def run(nats_url: str, prefix: str, labelled: bool, call: Callable[[Client], Any]) -> tuple[Any, Runtimes | None]:
    """One request through the client; with `labelled`, also the fleet's runtimes (for labels)."""

    async def work(nc: Any) -> tuple[Any, Runtimes | None]:
        reply = await call(Client(nc, prefix, on_unfenced=unfenced_note("placement", "--placement-seq", "placed")))
        return reply, (await runtime_labels(nc, prefix) if labelled else None)

    return ask(nats_url, work)


def stamp_label(stamp: ActorRuntime | None, runtimes: Runtimes) -> str:
    if stamp is None:
        return "unstamped"
    return pin_label(runtimes, stamp.sandbox_class, stamp.version, stamp.name)


def snapshot_text(snap: Snapshot, runtimes: Runtimes) -> str:
    where = f"LOCAL on {snap.node}" if snap.location.value == "LOCAL" else "EXTERNAL" + (f" {snap.uri}" if snap.uri else "")
    borrowed = ", borrowed" if snap.borrowed else ""
    return (f"snapshot {snap.snapshot_id}, {snap.fidelity.value}, {where}{borrowed}, "
            f"stamp {stamp_label(snap.sandbox_runtime, runtimes)}")


def done(kind: str, entity: str, what: str, seq: int, unchanged: bool = False) -> str:
    """`kind/entity what (seq N)`; `unchanged` (the reply's: the state already was so, nothing
    written) as kubectl says it: `kind/entity unchanged: already what (seq N)`."""
    return f"{kind}/{entity} {'unchanged: already ' if unchanged else ''}{what} (seq {seq})"


def echo(reply: Any, as_json: bool, text: Callable[[], str]) -> None:
    if as_json:
        echo_json(to_builtins(reply))
    else:
        click.echo(text())


MANY_IN_FLIGHT = 16  # requests in flight at once of a command given several ids (`each_one`)


def each_one(nats_url: str, prefix: str, kind: str, ids: tuple[str, ...],
             call: Callable[[Client, str], Awaitable[Any]], line: Callable[[str, Any, Any], str], as_json: bool,
             what: str, labelled: bool = False) -> None:
    """`call(client, id)` for each of several workers or actors (`kind`) over one connection,
    MANY_IN_FLIGHT at once: a loop of one command each took 0.5 s a worker (0.7 s an actor's resume), ten
    minutes for a thousand workers (a trial at fleet size). Each done is printed as it is answered (`line(id,
    reply, runtimes)`; `runtimes`: the fleet's labels, with `labelled`, read once, after the first reply, as
    the command of one id reads them); a refusal is said on stderr (`error: worker/W: CODE ...`) and the
    others go on; the last line counts the refused, exit status 1. -o json: a list in the order given, each
    reply with its id (`worker_id`, `actor_id`), or the error. A request nobody answers (`NobodyAnswered`:
    nothing subscribes to the service's subjects, a --prefix no deployment has or the service not running)
    ends the command at once, said as the command of one id says it (`ask`: where the logs are): no other
    id fares better (it was said once per id, each after its attempts, a thousand lines for a thousand
    workers, none saying where the logs are)."""
    ids = tuple(dict.fromkeys(ids))
    replies: dict[str, Any] = {}

    async def work(nc: Any) -> None:
        client = Client(nc, prefix, on_unfenced=unfenced_note("placement", "--placement-seq", "placed"))
        gate = asyncio.Semaphore(MANY_IN_FLIGHT)
        labels: list[asyncio.Future] = []  # the fleet's labels, read once, after the first reply (as one id's)

        async def runtimes() -> Runtimes | None:
            if not labelled or as_json:
                return None
            if not labels:
                labels.append(asyncio.ensure_future(runtime_labels(nc, prefix)))
            return await asyncio.shield(labels[0])

        async def one(one_id: str) -> None:
            async with gate:
                try:
                    replies[one_id] = reply = await call(client, one_id)
                except NobodyAnswered:
                    raise  # the service is not there for any of them: `ask` says it once
                except ContractError as e:
                    replies[one_id] = e
                    click.echo(f"error: {kind}/{one_id}: {Failed(e).message}", err=True)
                    return
            if not as_json:
                labelled_by = await runtimes()
                click.echo(line(one_id, reply, labelled_by))

        tasks = [asyncio.ensure_future(one(one_id)) for one_id in ids]
        try:
            await asyncio.gather(*tasks)
        finally:  # one failed for all (or the command was interrupted): the others are not waited for
            for task in (*tasks, *labels):
                task.cancel()
            await asyncio.gather(*tasks, *labels, return_exceptions=True)

    ask(nats_url, work)
    refused = [i for i in ids if isinstance(replies.get(i), ContractError)]
    if as_json:
        echo_json([{f"{kind}_id": i, "error": {"code": r.code.value, "message": r.message, "field": r.field}}
                   if isinstance(r, ContractError) else {f"{kind}_id": i, **to_builtins(r)}
                   for i, r in ((i, replies[i]) for i in ids)])
    if refused:
        click.echo(f"error: {len(refused)} of {len(ids)} {kind}s not {what}: {named_few(refused)}", err=True)
        raise SystemExit(1)


def one_request_id(request_id: str | None, ids: tuple[str, ...], argument: str = "WORKER_ID",
                   option: str = "--request-id") -> None:
    """--request-id (or --life-seq) names one request (one actor's life): a usage error with several ids."""
    if request_id is not None and len(set(ids)) > 1:
        raise click.UsageError(f"{option} names one {'request' if option == '--request-id' else 'life'}: give one "
                               f"{argument} with it")


# --- actor ---------------------------------------------------------------------------------------


@click.group()
def actor() -> None:
    """Create, pause, suspend, resume, tag, revert, re-template, stop and show actors."""


class UpperChoice(click.Choice):
    """Choices taken in any case and shown in upper case, as the views print them and as the default
    reads (click shows a case-insensitive choice in lower case: `[memory|volumes|rootfs]` with
    `[default: ROOTFS]`, in its help and its usage errors)."""

    def normalize_choice(self, choice: Any, ctx: click.Context | None) -> str:  # click >= 8.2; 8.1 shows them as given
        return super().normalize_choice(choice, ctx).upper()


FIDELITIES = UpperChoice([f.value for f in Fidelity], case_sensitive=False)  # `memory` as `--state paused` is


@actor.command("create")
@click.argument("actor_id", callback=check_id)  # (before the create is checked whole: `check_create_body`)
@click.option("--class", "sandbox_class", required=True, callback=field_of(CreateActor, "sandbox_class"),
              help="Sandbox class, e.g. gvisor: 1 to 63 lower-case letters, digits or '-', the first a letter.")
@click.option("--template", "template_uid", required=True, callback=field_of(CreateActor, "template_uid"),
              help="Template uid (an id) the actor starts from.")
@click.option("--cpu", "cpu_millis", type=MILLICORES, required=True, metavar="MILLICORES",
              help="CPU in whole millicores, at least 1: 500 or 500m (a core is 1000m).")
@click.option("--memory", "memory_mib", type=MIB, required=True, metavar="MIB",
              help="Memory in whole MiB, at least 1: 1024, 1024Mi or 1Gi.")
@click.option("--selector", "selectors", multiple=True, metavar="KEY=VALUE",
              callback=field_of(CreateActor, "selectors"),
              help="Worker label to require. Repeatable, one value per key.")
@click.option("--min-fidelity", type=FIDELITIES, default=Fidelity.ROOTFS.value,
              show_default=True, help="No restore below this fidelity. MEMORY: the actor resumes only from a "
                                      "MEMORY snapshot of its template stamped with a runtime (--source-tag, "
                                      "--golden-snapshot); without one, never (a warning says so).")
@click.option("--source-tag", default=None, callback=field_of(CreateActor, "source_tag"),
              help="Start from the snapshot this tag (an id) names.")
@click.option("--golden-snapshot", "golden", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Start from this Snapshot (a JSON file): EXTERNAL, on no node, with a uri; "
                                 "stamped (sandbox_runtime) if its memory is to be restored; "
                                 "examples/golden-snapshot.json is one. `warmboot schema --check FILE --as Snapshot "
                                 "--strict` checks the file's form as the create reads it; the create checks the "
                                 "rest.")
@request_id_option(CreateActor)
@nats_option
@prefix_option
@json_option
def create_cmd(actor_id: str, sandbox_class: str, template_uid: str, cpu_millis: int, memory_mib: int,
               selectors: tuple[str, ...], min_fidelity: str, source_tag: str | None, golden: Path | None,
               request_id: str | None, nats_url: str, prefix: str, as_json: bool) -> None:
    """Create ACTOR_ID (snapshotter.create)."""
    golden_snapshot = None
    if golden is not None:
        data = golden.read_bytes()
        golden_snapshot = file_body(Snapshot, data, str(golden), "--golden-snapshot")
        ignored = unknown_fields(Snapshot, msgspec.json.decode(data))  # a person's file: a misspelt key is said
        if ignored:
            raise click.BadParameter(f"{golden} at {', '.join(map(json_path, ignored))}: no such field in a Snapshot "
                                     "(the service would drop it; `warmboot schema` lists the fields)",
                                     param_hint="'--golden-snapshot'")
    body = CreateActor(actor_id=actor_id, sandbox_class=sandbox_class, template_uid=template_uid,
                       resources=Resources(cpu_millis=cpu_millis, memory_mib=memory_mib),
                       selectors=selectors_of(selectors), min_fidelity=Fidelity(min_fidelity),
                       source_tag=source_tag, golden_snapshot=golden_snapshot, request_id=request_id)
    check_create_body(body, golden)

    async def work(nc: Any) -> tuple[Any, Created]:
        wb = Client(nc, prefix)
        reply = await wb.create(body, warn=False)  # said in the CLI's words, `create_warnings`
        read = Created(snapshot=golden_snapshot)
        if source_tag is not None:  # the tag's snapshot, as copied: its template and stamp, and the floor
            read.snapshot = await wb.started_from(actor_id, reply.seq)
            if read.snapshot is None:  # a snapshotter of an earlier version: the log, which a client may not read
                try:
                    history = await read_subject(nc, prefix, event_subject(prefix, "actor", actor_id))
                    read.snapshot = [e for seq, e in history
                                     if isinstance(e, ActorCreated) and seq <= reply.seq][-1].snapshot
                except (click.ClickException, ContractError, OSError, asyncio.TimeoutError, nats.errors.Error,
                        IndexError) as e:
                    read.tag_unread = ("its ActorCreated is not in the log" if isinstance(e, IndexError)
                                       else unread_why(e))
        try:  # the fleet as the scheduler counts it: its classes, their undrained workers, the stamps they accept
            read.answer = await wb.fragmentation(min_seq=reply.seq)
        except (ContractError, OSError, asyncio.TimeoutError, nats.errors.Error) as e:
            read.unasked = unread_why(e)  # no scheduler answering: said in a note, nothing checked
        ours = read.class_of(sandbox_class)
        if read.answer is None:
            return reply, read
        if read.snapshot is not None and read.snapshot.sandbox_runtime is not None:  # a stamp's label, if not accepted
            read.runtimes = await asked_runtimes(nc, prefix, min_seq=reply.seq)
        if body.selectors and ours is not None and ours.workers:
            try:  # as the scheduler checks a resume of it: whether any undrained worker of the class has the labels
                read.explained = await wb.explain(actor_id, min_seq=reply.seq)
            except (ContractError, OSError, asyncio.TimeoutError, nats.errors.Error) as e:
                read.unexplained = unread_why(e)
        if ours is None or not ours.workers or ours.largest is None:
            # no undrained worker of the class (which are drained, which classes run), or a scheduler of an
            # earlier version (no `largest`): the workers as the views read them (a client's credentials may not)
            try:
                read.projection = await fleet(nc, prefix, await last_seq(nc, prefix, LABELS_TIMEOUT_S))
            except (click.ClickException, ContractError, OSError, asyncio.TimeoutError, nats.errors.Error) as e:
                read.unread = unread_why(e)
        return reply, read

    reply, read = ask(nats_url, work)
    echo(reply, as_json, lambda: done("actor", actor_id, "created", reply.seq))
    for line in create_warnings(body, read):
        click.echo(line, err=True)


@dataclass
class Created:
    """What `actor create` read after its create, for its warnings (`create_warnings`): the scheduler's
    answers, each at least at the create's sequence. The workers' histories are read only for a class
    no undrained worker runs (to name the drained ones and the classes that run), or when the scheduler
    is of an earlier version (no `largest` in its fragmentation): at 10,000 workers that read was 2.8 s
    of every create's 3.25 (docs/scaling.md, "Which commands grow with the fleet")."""

    snapshot: Snapshot | None = None  # the actor's first: the --golden-snapshot file's, or the tag's as copied
    tag_unread: str | None = None  # why the tag's snapshot could not be read
    answer: Fragmentation | None = None  # the scheduler's fragmentation (None: it did not answer)
    unasked: str | None = None  # why it did not answer
    runtimes: Runtimes | None = None  # the scheduler's `runtimes`, to label a stamp (None: it did not say them)
    explained: Explanation | None = None  # the scheduler's explain of the actor, asked with --selector alone
    unexplained: str | None = None  # why it could not be asked
    projection: Any = None  # the registered workers (`fleet`), read only as said above
    unread: str | None = None  # why they could not be (a client's credentials may not read the log)

    def class_of(self, sandbox_class: str) -> ClassFragmentation | None:
        """The class's entry in the scheduler's fragmentation; None if it did not answer or knows no worker of it."""
        if self.answer is None:
            return None
        return next((c for c in self.answer.classes if c.sandbox_class == sandbox_class), None)

    def labels(self) -> Runtimes:
        """The runtimes to label a stamp with: the scheduler's, else the workers' as read, else digits alone."""
        if self.runtimes is not None:
            return self.runtimes
        return runtimes_of(self.projection) if self.projection is not None else Runtimes(complete=False)


def none_passes(explained: Explanation | None, check: str) -> bool:
    """Whether the scheduler's explain of an actor found that no undrained worker of its class passes
    `check` (`feasibility.none_passes` of its tally: `selector mismatch`, no worker has the labels its
    selectors ask for; `runtime mismatch`, none of those that have them accepts the stamp of its
    snapshot, the first requirement explain tallies); False without an explain."""
    return explained is not None and feasibility_none_passes(explained.candidates, explained.counts, check)


def labels_asked(body: CreateActor) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(body.selectors.items()))


def create_warnings(body: CreateActor, read: Created) -> list[str]:
    """What `actor create` says on stderr of the actor it created, from what it read (`Created`): a
    create the contract takes whose resumes will be refused, or will not restore its snapshot's memory,
    is said at once (warnings), and a check that could not be made is said too (notes)."""
    aid, cls, tag = body.actor_id, body.sandbox_class, body.source_tag
    lines = []
    memory_floor = body.min_fidelity is Fidelity.MEMORY
    never = None if not memory_floor or read.tag_unread else below_memory(read.snapshot, body.template_uid,
                                                                          ("--golden-snapshot", "--source-tag"))
    ours = read.class_of(cls)
    live = ours is not None and ours.workers > 0  # a registered, undrained worker runs the class
    if never is not None:  # taken, as the contract allows; said instead of the warnings below, which it overrules
        lines.append(f"warning: {aid} can never be resumed: its --min-fidelity is MEMORY and {never}; no resume may "
                     "go below its floor, so every resume is refused (FAILED_PRECONDITION). Create it from a MEMORY "
                     "snapshot of its template stamped with a runtime (--source-tag, --golden-snapshot), or with a "
                     "lower --min-fidelity")
    elif read.tag_unread and memory_floor:  # a client's credentials may not read the log
        lines.append(f"note: --min-fidelity MEMORY not checked against the snapshot of tag {tag}: {read.tag_unread}")
    elif read.tag_unread:
        lines.append(f"note: the snapshot of tag {tag} not checked against --template and the workers' runtimes: "
                     f"{read.tag_unread}")
    else:
        lost = memory_lost(body, read, live)
        if lost is not None:
            lines.append(f"warning: {lost}")
    said = class_unserved(body, read, ours)
    if said is not None:
        lines.append(f"warning: {said}")
    elif read.answer is None and read.unasked:  # nothing checked: said, as the other checks not made are
        checks = ["its class", "its size", *(["--selector"] if body.selectors else []),
                  *(["its snapshot's stamp"] if read.snapshot is not None else [])]
        lines.append(f"note: {aid} not checked against the workers ({', '.join(checks)}): the scheduler did not "
                     f"answer ({read.unasked})")
    elif live and body.selectors and none_passes(read.explained, SELECTOR_MISMATCH):  # refused at resume
        lines.append(f"warning: no undrained worker of class {cls} has the labels {labels_asked(body)}; "
                     f"resuming {aid} is refused until one does (`warmboot workers -o wide` shows their labels)")
    elif live and body.selectors and read.unexplained:
        lines.append(f"note: --selector not checked against the workers' labels: {read.unexplained}")
    elif (live and body.selectors and never is None and read.explained is not None
          and read.explained.refusal is not None and not read.explained.counts):  # no worker looked at
        refusal = read.explained.refusal
        lines.append(f"note: --selector not checked against the workers' labels: the scheduler's explain of {aid} "
                     f"looked at no worker: {refusal.code.value}: {refusal.message}")
    if live:  # a bigger worker may register later: taken
        from services.scheduler.decide import bigger_than, too_big_for_class  # as the scheduler's refusal says it

        cpu, memory = body.resources.cpu_millis, body.resources.memory_mib
        too_big = (bigger_than((ours.largest.cpu_millis, ours.largest.memory_mib), cpu, memory)
                   if ours.largest is not None  # else a scheduler of an earlier version: the workers as read
                   else too_big_for_class(read.projection, cls, cpu, memory) if read.projection is not None else None)
        if too_big is not None:
            lines.append(f"warning: no registered worker of class {cls} is big enough for {aid}: {too_big}; "
                         f"resuming {aid} is refused (RESOURCE_EXHAUSTED) until a bigger worker registers")
    return lines


def class_unserved(body: CreateActor, read: Created, ours: Any) -> str | None:
    """Why no worker takes the actor's class now, or None if one does (or the scheduler did not say):
    none registered runs it (a mistyped class is accepted, and refused at resume), or every one that
    does is drained (a drain lasts the worker's life; it read as "runs: none", a trial)."""
    if read.answer is None or (ours is not None and ours.workers > 0):
        return None
    from services.scheduler.whatif import registered_classes  # as `whatif --class` names them

    aid, cls = body.actor_id, body.sandbox_class
    runs = ", ".join(registered_classes(read.projection) if read.projection is not None  # drained ones too
                     else sorted(c.sandbox_class for c in read.answer.classes if c.workers)) or "none"
    if ours is not None and read.projection is None:  # known to the scheduler: drained or gone, not looked up
        return (f"no undrained worker runs the sandbox class {cls!r} (the fleet runs: {runs}; whether drained ones do "
                f"was not looked up: {read.unread}); resuming {aid} is refused until one does")
    registered = [w for w in read.projection.workers.values() if cls in w.classes] if read.projection else []
    if any(w.live for w in registered):  # one registered since the scheduler answered
        return None
    if registered:
        drained = named_few(sorted(w.worker_id for w in registered))
        return (f"every registered worker of class {cls} is drained: {drained}; resuming {aid} is refused "
                "until an undrained one registers (a drain lasts the worker's life: `warmboot worker remove` it and "
                "let its agent register it anew)")
    return (f"no registered worker runs the sandbox class {cls!r} (the fleet runs: {runs}); resuming {aid} is refused "
            "until one does")


def memory_lost(body: CreateActor, read: Created, live: bool) -> str | None:
    """Why the first resume of the actor will not restore the memory of the snapshot it is created
    from, as the scheduler's plan gives it up (services.scheduler.decide, rules 3 and 4), or None:
    a snapshot of another template (TEMPLATE_CHANGED), one with no stamp (SNAPSHOT_NOT_MEMORY), a
    stamp no undrained worker of the class accepts, as fragmentation counts them, or none of those with
    the labels its selectors ask for, as the scheduler's explain of it says (NO_COMPATIBLE_WORKER; a
    MEMORY floor refuses the resume instead). The contract takes each; a trial's creates said nothing
    (and a create with selectors said nothing of a stamp only workers without the labels accept)."""
    snapshot, aid, cls = read.snapshot, body.actor_id, body.sandbox_class
    if snapshot is None or snapshot.fidelity is not Fidelity.MEMORY:
        return None
    what = (f"the golden snapshot {snapshot.snapshot_id!r}" if body.golden_snapshot is not None
            else f"the snapshot {snapshot.snapshot_id!r} of tag {body.source_tag}")
    borrowed = snapshot.borrowed or body.golden_snapshot is not None  # the snapshotter borrows a golden one
    instead = "cold-boots instead of restoring it" if borrowed else "restores it at VOLUMES, without its memory"
    if snapshot.template_uid != body.template_uid:
        return (f"{what} was taken from template {snapshot.template_uid!r}, not {body.template_uid!r}: {aid} "
                f"{instead} (TEMPLATE_CHANGED)")
    stamp = snapshot.sandbox_runtime
    if stamp is None:
        return (f"{what} holds memory but no sandbox_runtime: no worker can restore its memory, so {aid} starts "
                "without it (SNAPSHOT_NOT_MEMORY)")
    if not live or stamp.sandbox_class != cls:
        return None  # no worker takes the class (said so apart); a stamp of another class is refused at create
    accepted = accepts(read.answer, stamp)
    if accepted is False:
        nowhere = f"no undrained worker of class {cls}"
    elif accepted and body.selectors and none_passes(read.explained, RUNTIME_MISMATCH):
        nowhere = f"no undrained worker of class {cls} with the labels {labels_asked(body)}"
    else:
        return None
    runtimes = read.labels()
    then = (f"resuming {aid} is refused (its --min-fidelity is MEMORY)" if body.min_fidelity is Fidelity.MEMORY
            else f"{aid} {instead} (NO_COMPATIBLE_WORKER)")
    label = pin_label(runtimes, cls, stamp.version, stamp.name)
    return f"{nowhere} accepts the stamp {label} of {what}: until one does, {then}"


def accepts(answer: Fragmentation | None, stamp: ActorRuntime) -> bool | None:
    """Whether an undrained worker accepts a memory snapshot stamped `stamp` (as default, restorable
    or compatible version), as the scheduler's fragmentation counts them; None if it did not answer."""
    if answer is None:
        return None
    key = compat_key(stamp.sandbox_class, stamp.version)
    return any(compat_key(c.sandbox_class, rt.version) == key
               and rt.workers_default + rt.workers_restorable + rt.workers_compatible > 0
               for c in answer.classes if c.sandbox_class == stamp.sandbox_class for rt in c.runtimes)


@actor.command("pause")
@click.argument("actor_id")
@click.option("--snapshot-id", default=None, callback=field_of(PauseActor, "snapshot_id"),
              help="Id of the LOCAL memory snapshot (default: <actor>-v<n>); refused if it names "
                   "another snapshot, this actor's or another's.")
@placement_seq_option
@placement_file_option
@request_id_option(PauseActor)
@nats_option
@prefix_option
@json_option
def pause_cmd(actor_id: str, snapshot_id: str | None, placement_seq: int | None, placement_file: Any,
              request_id: str | None, nats_url: str, prefix: str, as_json: bool) -> None:
    """Pause a RUNNING actor: a LOCAL memory snapshot on its node, stamped with its pin."""
    placed = placement_named(actor_id, placement_seq, placement_file)

    async def call(wb: Client) -> Any:
        return await wb.pause(actor_id, snapshot_id, request_id, placement_seq, placed)

    reply, runtimes = run(nats_url, prefix, not as_json, call)
    echo(reply, as_json, lambda: done("actor", actor_id, "paused: " + snapshot_text(reply.snapshot, runtimes),
                                      reply.seq))


@actor.command("suspend")
@click.argument("actor_id")
@click.option("--fidelity", type=FIDELITIES, default=Fidelity.MEMORY.value,
              show_default=True, help="What the EXTERNAL snapshot can restore.")
@click.option("--uri", default=None, callback=field_of(SuspendActor, "uri"),
              help="Where the snapshot is stored: any text the workers' external store names it by (s3://..., a "
                   "path, a key), at most 2048 printable characters, not blank.")
@click.option("--snapshot-id", default=None, callback=field_of(SuspendActor, "snapshot_id"),
              help="Id of the snapshot (default: <actor>-v<n>); refused if it names another "
                   "snapshot, this actor's or another's.")
@placement_seq_option
@placement_file_option
@request_id_option(SuspendActor)
@nats_option
@prefix_option
@json_option
def suspend_cmd(actor_id: str, fidelity: str, uri: str | None, snapshot_id: str | None, placement_seq: int | None,
                placement_file: Any, request_id: str | None, nats_url: str, prefix: str, as_json: bool) -> None:
    """Suspend an actor: RUNNING -> an EXTERNAL snapshot stamped with its pin; PAUSED -> its
    LOCAL snapshot promoted to EXTERNAL (it may then move)."""
    placed = placement_named(actor_id, placement_seq, placement_file, SuspendActor)

    async def call(wb: Client) -> Any:
        return await wb.suspend(actor_id, Fidelity(fidelity), uri, snapshot_id, request_id, placement_seq, placed)

    reply, runtimes = run(nats_url, prefix, not as_json, call)
    echo(reply, as_json, lambda: done("actor", actor_id, "suspended: " + snapshot_text(reply.snapshot, runtimes),
                                      reply.seq))


@actor.command("resume")
@click.argument("actor_id", nargs=-1, required=True, metavar="ACTOR_ID", cls=OneOrMore)
@click.option("--selector", "selectors", multiple=True, metavar="KEY=VALUE",
              callback=field_of(ResumeActor, "selectors"),
              help="Extra worker label to require (narrows the actor's own selectors).")
@life_seq_option
@request_id_option(ResumeActor)
@min_seq_option
@nats_option
@prefix_option
@json_option
def resume_cmd(actor_id: tuple[str, ...], selectors: tuple[str, ...], life_seq: int | None, request_id: str | None,
               min_seq: int | None, nats_url: str, prefix: str, as_json: bool) -> None:
    """Place ACTOR_ID on a worker (scheduler.resume): where, at which fidelity, pinned to which runtime.

    Several actors (one or more ACTOR_ID): each resumed, a line each as it is placed (16 at once); one
    refused is said on stderr and the others go on (exit status 1, the last line counting them);
    --json gives a list, each reply with its actor_id."""
    sel = selectors_of(selectors) or None
    one_request_id(request_id, actor_id, "ACTOR_ID")
    one_request_id(life_seq, actor_id, "ACTOR_ID", "--life-seq")

    async def resumed(wb: Client, one_id: str) -> Any:
        notes: list[str] = []
        life = await life_now(wb, one_id, life_seq, resume=True, note=notes.append)
        try:
            return await wb.resume(one_id, sel, request_id, min_seq, life)
        except (NobodyAnswered, asyncio.CancelledError):
            # no scheduler either (a prefix no deployment has, nothing running): the error says it, and that
            # the resume went unfenced is noise before it (a user trial: a long note, then the error); nor is
            # it said of a resume of several given up on as another found no scheduler (`each_one`)
            notes.clear()
            raise
        finally:
            for line in notes:  # said once the resume is answered: it went without the fence
                click.echo(line, err=True)

    if len(set(actor_id)) > 1:
        each_one(nats_url, prefix, "actor", actor_id, resumed, placed_line, as_json,
                 "placed", labelled=True)
        return
    reply, runtimes = run(nats_url, prefix, not as_json, lambda wb: resumed(wb, actor_id[0]))
    if as_json:
        echo_json(to_builtins(reply))
        return
    fields = [("ACTOR", actor_id[0]), *decision_fields(reply, runtimes, False), ("SEQ", str(reply.seq))]
    click.echo(render_fields(fields, terminal_width()))


def placed_line(actor_id: str, reply: Any, runtimes: Runtimes) -> str:
    """A resume's placement in one line, as `actor resume` of several actors prints each: its DECISION,
    WORKER, RUNTIME and FALLBACK fields (`decision_fields`), and its sequence."""
    fields = dict(decision_fields(reply, runtimes, False))
    fallback = f", fallback {fields['FALLBACK']}" if "FALLBACK" in fields else ""
    return (f"actor/{actor_id} {fields['DECISION']} on {fields['WORKER']}, runtime {fields['RUNTIME']}{fallback} "
            f"(seq {reply.seq})")


@actor.command("tag")
@click.argument("actor_id")
@click.argument("tag")
@life_seq_option
@request_id_option(TagSnapshot)
@nats_option
@prefix_option
@json_option
def tag_cmd(actor_id: str, tag: str, life_seq: int | None, request_id: str | None, nats_url: str, prefix: str,
            as_json: bool) -> None:
    """Tag the actor's latest snapshot (EXTERNAL only) so that other actors can be created from it.
    A tag that named another snapshot now names this one: the output says which it named (with
    --json, on stderr, as the other commands' warnings). A tag that names it already is left as it
    is, nothing written (`unchanged: already tagged ...`)."""

    async def work(nc: Any) -> tuple[Any, Runtimes | None, Snapshot | str | None]:
        wb = Client(nc, prefix)
        reply = await wb.tag(actor_id, tag, request_id, await life_now(wb, actor_id, life_seq))
        before: Snapshot | str | None
        labels = None if as_json else await runtime_labels(nc, prefix)  # for the text
        if reply.tagged_before is not None:  # the snapshotter said it (since 2026-12-07): no log read
            return reply, labels, reply.tagged_before.snapshot
        try:
            history = await read_subject(nc, prefix, event_subject(prefix, "tag", tag))
        except (ContractError, click.ClickException) as e:  # the tag is recorded: only what it named before is
            # not known (a history this CLI cannot read; a log these credentials may not read, as a client's)
            before = unread_why(e)
        else:
            named = [(seq, e.snapshot) for seq, e in history if isinstance(e, TagRecorded)]
            ours = [i for i, (seq, snap) in enumerate(named) if seq <= reply.seq and snap == reply.snapshot]
            before = named[ours[-1] - 1][1] if ours and ours[-1] > 0 else None
        return reply, labels, before

    reply, runtimes, before = ask(nats_url, work)
    if reply.unchanged:  # it named this snapshot already: nothing written, nothing moved
        note = None
    elif isinstance(before, str):
        note = f"what {tag} named before is not known: {before}"
    elif before is not None and before != reply.snapshot:  # an id's image may be another actor's copy: all of it
        note = f"{tag} moved: it named snapshot {before.snapshot_id} of actor {before.actor_id} before"
    else:
        note = None

    def text() -> str:
        said = done("actor", actor_id, f"tagged {tag}: " + snapshot_text(reply.snapshot, runtimes), reply.seq,
                    reply.unchanged)
        return said if note is None else f"{said}\n{note}"

    echo(reply, as_json, text)
    if as_json and note is not None:  # the reply alone on stdout (a trial: --json said nothing of the move)
        click.echo(f"note: {note}", err=True)


@actor.command("revert")
@click.argument("actor_id")
@click.option("--reason", default=None, callback=field_of(RevertActor, "reason"),
              help="Recorded on ActorReverted: at most 256 printable characters.")
@life_seq_option
@request_id_option(RevertActor)
@nats_option
@prefix_option
@json_option
def revert_cmd(actor_id: str, reason: str | None, life_seq: int | None, request_id: str | None, nats_url: str,
               prefix: str, as_json: bool) -> None:
    """Give up the actor's LOCAL image and go back to its latest EXTERNAL snapshot (or to none:
    it will cold-boot). What runs since that snapshot is lost."""
    async def call(wb: Client) -> Any:
        return await wb.revert(actor_id, reason, request_id, await life_now(wb, actor_id, life_seq))

    reply, runtimes = run(nats_url, prefix, not as_json, call)

    def text() -> str:
        back = snapshot_text(reply.snapshot, runtimes) if reply.snapshot else "no snapshot: it will cold-boot"
        return done("actor", actor_id, f"reverted to {back}", reply.seq)

    echo(reply, as_json, text)


@actor.command("update-template")
@click.argument("actor_id")
@click.argument("template_uid")
@life_seq_option
@request_id_option(UpdateTemplate)
@nats_option
@prefix_option
@json_option
def update_template_cmd(actor_id: str, template_uid: str, life_seq: int | None, request_id: str | None, nats_url: str,
                        prefix: str, as_json: bool) -> None:
    """Move ACTOR_ID to another template: its memory snapshots of the old one restore without memory.

    To the template it has already: nothing is written, and it prints `unchanged`."""
    async def call(wb: Client) -> Any:
        return await wb.update_template(actor_id, template_uid, request_id, await life_now(wb, actor_id, life_seq))

    reply, _ = run(nats_url, prefix, False, call)
    echo(reply, as_json, lambda: done("actor", actor_id, f"on template {template_uid}", reply.seq, reply.unchanged))


@actor.command("stop")
@click.argument("actor_id")
@life_seq_option
@request_id_option(StopActor)
@nats_option
@prefix_option
@json_option
def stop_cmd(actor_id: str, life_seq: int | None, request_id: str | None, nats_url: str, prefix: str,
             as_json: bool) -> None:
    """Stop ACTOR_ID (released from its worker if placed). A create of the same id starts a new life."""
    async def call(wb: Client) -> Any:
        return await wb.stop(actor_id, request_id, await life_now(wb, actor_id, life_seq))

    reply, _ = run(nats_url, prefix, False, call)
    echo(reply, as_json, lambda: done("actor", actor_id, "stopped", reply.seq))


def actor_view(actor_id: str, projection: Any, runtimes: Runtimes) -> dict:
    """What the projection folded of one actor's history, as JSON values (labels beside the versions):
    its row of `actor list` (`summary_view`, the one definition of it) with the count of the events
    folded (`events`, before `last_seq`)."""
    from services.scheduler.actor_list import actor_summary

    a = projection.actors.get(actor_id)
    if a is None:
        raise no_actor(actor_id)
    view = summary_view(actor_summary(a, projection), runtimes)
    last_seq = view.pop("last_seq")
    return {**view, "events": projection.events, "last_seq": last_seq}


def actor_fields(view: dict, wide: bool) -> list[tuple[str, str]]:
    res = view["resources"]
    fields = [
        ("ACTOR", view["actor_id"]),
        ("STATE", view["state"]),
        ("CLASS", view["sandbox_class"]),
        ("TEMPLATE", view["template_uid"]),
        ("RESOURCES", f"{millis(res['cpu_millis'])} cpu, {mib(res['memory_mib'])} memory"),
        ("SELECTORS", key_values(view["selectors"])),
        ("MIN FIDELITY", view["min_fidelity"]),
    ]
    snap = view["snapshot"]
    if snap is None:
        fields.append(("SNAPSHOT", "none (a resume cold-boots)"))
    else:
        where = f"LOCAL on {snap['node']}" if snap["location"] == "LOCAL" else "EXTERNAL"
        fields.append(("SNAPSHOT", f"{snap['snapshot_id']}, {snap['fidelity']}, {where}"
                                   + (", borrowed" if snap["borrowed"] else "")))
        if snap.get("lost"):
            fields.append(("LOST", f"no registered worker of its class is on the disk its image is on (its node has "
                                   f"none, or registered from another disk since): `warmboot actor revert "
                                   f"{view['actor_id']}` gives it up"))
        if snap["template_uid"] != view["template_uid"]:
            fields.append(("SNAPSHOT OF", f"template {snap['template_uid']} (its memory is unusable)"))
        stamp = snap["stamp"]
        fields.append(("STAMP", stamp["label"] if stamp else "unstamped"))
        if wide and stamp:
            fields.append(("STAMP ID", stamp["runtime_id"]))
    if view["worker_id"]:
        fields.append(("WORKER", view["worker_id"]))
    if view["node"]:
        fields.append(("NODE", view["node"]))
    if view["pin"]:
        fields.append(("PIN", view["pin"]["label"]))
        if wide:
            fields.append(("PIN ID", view["pin"]["runtime_id"]))
    if view["booked"]:
        b = view["booked"]
        fields.append(("BOOKED", f"{millis(b['cpu_millis'])} cpu, {mib(b['memory_mib'])} memory"))
    fields.append(("HISTORY", f"{view['events']} events, the last at sequence {view['last_seq']}"))
    return fields


@actor.command("show")
@click.argument("actor_id", callback=check_id)
@nats_option
@prefix_option
@output_option
def show_actor_cmd(actor_id: str, nats_url: str, prefix: str, output: str | None, as_json: bool) -> None:
    """ACTOR_ID's state, latest snapshot and its stamp, and assignment, folded from its own history
    (`<prefix>.ev.actor.<id>`) with the scheduler's projection. With credentials that may not read
    the log (a client's), what the snapshotter's `status` says: its state, life and placement, and a
    note on stderr that the rest is in the log (a client had no command that said an actor's state)."""
    from services.scheduler.projection import Projection

    mode = output_mode(output, as_json)  # a usage error before anything is read

    async def work(nc: Any) -> tuple[dict, str | None]:
        try:
            records = await read_subject(nc, prefix, event_subject(prefix, "actor", actor_id))
        except LogUnreadable as e:
            if e.why != REFUSED_THE_LOG:
                raise
            status = await Client(nc, prefix).status(actor_id)
            return {"actor_id": actor_id, **to_builtins(status)}, e.why
        projection = Projection()
        for seq, event in records:
            projection.apply(seq, event)
        return actor_view(actor_id, projection, await fleet_runtimes(nc, prefix)), None

    view, unread = ask(nats_url, work)
    if unread is not None:
        click.echo(f"note: the snapshotter's status of {actor_id} only: {unread}, where its snapshot, stamp, "
                   "worker and pin are", err=True)
    if mode == "json":
        echo_json(view)
        return
    fields = actor_fields(view, mode == "wide") if unread is None else status_fields(view)
    click.echo(render_fields(fields, None if mode == "wide" else terminal_width()))


def status_fields(view: dict) -> list[tuple[str, str]]:
    """`actor show`'s fields from the snapshotter's status (`ActorStatus`, with `actor_id`)."""
    placed = view["placement_seq"]
    return [("ACTOR", view["actor_id"]), ("STATE", view["state"]),
            ("LIFE", f"created at sequence {view['life_seq']}"),
            ("PLACEMENT", "none in this life" if placed is None else f"at sequence {placed}"),
            ("LAST SEQ", str(view["seq"]))]


def _snapshot_cell(view: dict) -> str:
    snap = view["snapshot"]
    if snap is None:
        return "-"
    where = "LOCAL" if snap["location"] == "LOCAL" else "EXT"
    return f"{snap['fidelity']} {where}" + (" borrowed" if snap["borrowed"] else "")


ACTOR_LIST_COLUMNS = [
    Column("ACTOR", lambda v: v["actor_id"]),
    Column("STATE", lambda v: v["state"]),
    Column("CLASS", lambda v: v["sandbox_class"], drop=2),
    Column("WORKER", lambda v: v["worker_id"] or "-"),
    Column("SNAPSHOT", lambda v: _snapshot_cell(v), drop=1),
    Column("STAMP", lambda v: "-" if v["snapshot"] is None
           else (v["snapshot"]["stamp"] or {}).get("label", "unstamped"), drop=3),
    Column("TEMPLATE", lambda v: v["template_uid"], wide=True),
    Column("NODE", lambda v: v["node"] or "-", wide=True),
    Column("PIN", lambda v: v["pin"]["label"] if v["pin"] else "-", wide=True),
    Column("LAST SEQ", lambda v: str(v["last_seq"]), right=True, wide=True),
]


def summary_view(row: ActorSummary, runtimes: Runtimes) -> dict:
    """A row of `scheduler.actors` (`services.scheduler.actor_list.actor_summary`) as `actor list -o json`
    shows it: `actor_view`'s without `events`, its stamp and pin labelled."""
    def runtime(r: ActorRuntime | None) -> dict | None:
        if r is None:
            return None
        return {"label": pin_label(runtimes, r.sandbox_class, r.version, r.name),
                "runtime_id": short_id(compat_key(r.sandbox_class, r.version)), **to_builtins(r)}

    view = to_builtins(row)
    if row.snapshot is not None:
        view["snapshot"]["stamp"] = runtime(row.snapshot.stamp)
    view["pin"] = runtime(row.pin)
    return view


CLASS_RE = re.compile(CLASS_PATTERN)  # `workers --class`: a class's name, sent; any other, said unknown


def folded_actors(projection: Any, query: ActorsQuery) -> list[ActorPage]:
    """Every page of `query` from a fold of the log (`actor_page`, what a scheduler answers)."""
    from services.scheduler.actor_list import actor_page

    return folded_pages(lambda q: actor_page(projection, q), query)


@actor.command("list")
@click.option("--class", "sandbox_classes", multiple=True, callback=field_of(ActorsQuery, "sandbox_classes"),
              help="Only actors of this sandbox class. Repeatable: actors of any class given.")
@click.option("--state", "states", multiple=True, callback=lambda ctx, param, values: tuple(map(one_state, values)),
              metavar="[" + "|".join(s.value for s in ActorState) + "]",
              help="Only actors in this state (in any case). Repeatable: actors in any state given.")
@click.option("--worker", "worker_ids", multiple=True,
              callback=field_of(ActorsQuery, "worker_ids"),
              help="Only actors placed on this worker. Repeatable: actors placed on any worker given.")
@paging_options("actors", "ACTOR", ActorsQuery)
@nats_option
@prefix_option
@output_option
def list_actors_cmd(sandbox_classes: tuple[str, ...], states: tuple[str, ...], worker_ids: tuple[str, ...],
                    limit: int | None, after: str | None, nats_url: str, prefix: str, output: str | None,
                    as_json: bool) -> None:
    """The actors of the log (stopped ones included), by id: state, worker, latest snapshot and its
    stamp. Asked of a scheduler replica, a page at a time (`scheduler.actors`: pages are not one
    snapshot, an actor created meanwhile is listed if its id sorts after those listed already); only
    when none answers, the log folded with the scheduler's projection (as `workers` then does).

    A table lists the first 500 (--limit), and then says on stderr how to list the next ones
    (--continue ID); -o json lists every one, printed a page at a time.

    A filter given more than once takes any of its values (`--state SUSPENDED --state PAUSED`:
    both); different filters all apply."""
    mode = output_mode(output, as_json)
    most = listing_limit(limit, mode)
    # a filter given more than once: any of its values (it kept the last one alone: a walkthrough)
    query = ActorsQuery(sandbox_classes=tuple(dict.fromkeys(sandbox_classes)),
                        states=tuple(ActorState(s) for s in dict.fromkeys(states)),
                        worker_ids=tuple(dict.fromkeys(worker_ids)), after=after, limit=ACTORS_LIMIT_MAX)
    columns, cells_of = cell_columns(ACTOR_LIST_COLUMNS)

    table: list[tuple[str, ...]] = []  # each row's cells (`cell_columns`), not the row
    placed_on: set[str | None] = set()

    def each(page: ActorPage, from_log: bool, runtimes: Runtimes, listed: JsonList | None) -> None:
        if not from_log:  # the names the log's stamps and pins give runtimes no worker names (`runtimes_of`)
            for r in (*page.stamp_names, *(s for row in page.actors
                                           for s in (row.snapshot and row.snapshot.stamp, row.pin) if s)):
                runtimes.stamp(r.sandbox_class, r.version, r.name)
        for row in page.actors:
            view = summary_view(row, runtimes)
            if listed is not None:
                listed.add(with_runtime_ids(view))
            else:
                table.append(cells_of(view))
            placed_on.add(row.worker_id)

    async def work(nc: Any) -> Walked:  # (only a page asked without --continue says what matches nothing)
        from services.scheduler.actor_list import actor_page

        walked = await walk_listing(nc, prefix, "actors", mode, query, most, ACTORS_LIMIT_MAX, lambda c: c.actors,
                                    actor_page, lambda page: page.actors, said_of_filters,
                                    after is not None and bool(sandbox_classes or worker_ids), each)
        unplaced_notes(placed_on)
        return walked

    first_page: list[ActorPage] = []

    def said_of_filters(first: ActorPage) -> None:
        """A value no actor could match reads like a typo: said, not only left out of the list (on stderr,
        before the rows: the first page says it)."""
        first_page.append(first)
        for sandbox_class in first.unknown_classes:
            click.echo(f"note: no actor of the log is of the sandbox class '{sandbox_class}' (its actors': "
                       f"{', '.join(first.classes) or 'none'})", err=True)

    def unplaced_notes(placed_on: set) -> None:
        for worker_id in first_page[0].unknown_workers if first_page else ():
            if worker_id not in placed_on:
                click.echo(f"note: worker '{worker_id}' is not registered (`warmboot workers` lists those that are)",
                           err=True)

    walked = ask(nats_url, work)
    more = cut_short("actors", walked.count, walked.next_after, most)
    if mode != "json":
        if not table:
            none = "no actor matches" if (sandbox_classes or states or worker_ids) else "no actors"
            click.echo(f"{none} after {after} (--continue)" if after else none)
        else:
            width = terminal_width()
            echo_table(render_table(columns, table, width, mode == "wide"), width)
    if more is not None:
        click.echo(more, err=True)

"""What the operator commands share: NATS options, one-shot connections, replaying the log."""

from __future__ import annotations

import asyncio
import math
import re
import sys
from typing import Any, AsyncIterator, Awaitable, Callable, get_args

import click
import msgspec
import msgspec.inspect
import nats.js.errors
from click.core import ParameterSource
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from events.codec import GIVEN_CHARS, decode_request, encode, quoted
from events.compat import compat_key, describe_key
from events.errors import ContractError, not_found, past_the_end
from events.natsauth import NKEY_SEED_ENV, carries_secret, check_url, nkey_seed_problem, redact_url
from events.natspy.connections import ErrorsOnce, PublishRefused, close_within, describe_error, unless_refused
from events.schema import ID_RE, ID_WORDS, PATTERN_WORDS, ErrorCode, Positive
from events.subjects import DEFAULT_PREFIX, PREFIX_PATTERN, check_prefix, stream_name
from services.process import EVENT_LOOP_ENV, EVENT_LOOPS
from services.streams import leaders_stream_info
from warmboot.client import NO_SERVICE, no_service_hint
from warmboot.connection import CONNECT_TIMEOUT_S, connect_within, hears_replies



def check_nats_option(ctx: click.Context | None, param: click.Parameter | None, value: str) -> str:
    """A --nats value nats-py connects to (`events.natsauth.check_url`), or a usage error naming it.
    A password or token given on the command line is warned of: any user of the machine reads a
    process's arguments (ps, /proc/<pid>/cmdline), and could sign in as its owner."""
    try:
        url = check_url(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if (ctx is not None and param is not None and param.name is not None and carries_secret(url)
            and ctx.get_parameter_source(param.name) is ParameterSource.COMMANDLINE):
        click.echo("warning: --nats carries a password (or token), which every user of this machine can read in "
                   "its process list: give the URL in $NATS_URL instead, or sign in with --nkey-seed", err=True)
    return url


def check_given_file(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """click callback of a file option whose default may be missing (`--cpuinfo`: a machine without
    /proc/cpuinfo reports the architecture alone): a path given, on the command line or in the
    environment, must be a file that can be read, else a usage error naming the option, before anything
    is read or sent (`probe --cpuinfo /nonexistent` printed the architecture alone, exit 0: a user
    trial). The default is left to the reader, which takes a missing one as none."""
    if value is None or param.name is None or ctx.get_parameter_source(param.name) in (
            ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP):
        return value
    return click.Path(exists=True, dir_okay=False, readable=True, path_type=type(value)).convert(value, param, ctx)


class IntRange(click.IntRange):
    """click's IntRange, whose value that is no number reads "'x' is not a valid integer" (click's
    own says "integer range", as if a range were asked for); the help shows INTEGER and the range."""

    name = "integer"


class FloatRange(click.FloatRange):
    """click's FloatRange, named as IntRange is: "'x' is not a valid float"."""

    name = "float"


def wire_bounds(wire: Any) -> tuple[int | None, int | None]:
    """The least and the greatest whole number a wire type of `events.schema` takes (`Positive`,
    `StreamSeq`: an `Annotated[int, Meta(...)]`), None where it sets none: the bounds the services
    check, for an option to check before anything is sent (one definition: the schema's)."""
    meta = next(m for m in get_args(wire)[1:] if isinstance(m, msgspec.Meta))
    low = meta.ge if meta.ge is not None else None if meta.gt is None else meta.gt + 1
    high = meta.le if meta.le is not None else None if meta.lt is None else meta.lt - 1
    return low, high


class Quantity(click.ParamType):
    """A whole number of `unit`, written bare or as kubectl writes it, with one of `suffixes`
    (`500m` millicores, `1Gi` MiB); anything else (`0.5`, `1.5Gi`, `1G`) is refused naming what to
    write, before anything is sent. A bare number stays the unit (`--cpu 2` is 2 millicores, as it
    always was here, not kubectl's 2 cores). One out of the bounds of the request's field (`wire`,
    `events.schema.Positive`: 1 to 2^40) is refused here too, naming them (`--cpu 0` was refused only
    once a server answered, exit 1: a user trial)."""

    def __init__(self, unit: str, suffixes: dict[str, int], example: str, wire: Any = Positive):
        self.name = unit
        self.suffixes = suffixes
        self.example = example
        self.bounds = wire_bounds(wire)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return self.within(value, value, param, ctx)
        text = str(value).strip()
        for suffix, factor in self.suffixes.items():
            digits = text.removesuffix(suffix)
            if digits != text and digits.isascii() and digits.isdigit():
                return self.within(int(digits) * factor, value, param, ctx)
        try:
            number = int(text)
        except ValueError:
            self.fail(f"{value!r} is not a whole number of {self.name}: write {self.example}", param, ctx)
        return self.within(number, value, param, ctx)

    def within(self, number: int, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        low, high = self.bounds
        if (low is not None and number < low) or (high is not None and number > high):
            self.fail(f"{value!r} is {number} {self.name}: a request takes {low} to {high} {self.name}", param, ctx)
        return number


# The examples read as examples ("e.g."): `write 1536, ...` read as the conversion of any value refused
# (`--memory 10Ti` was told to write 1536; a trial). Both are a request's `Resources` (`Positive`).
MILLICORES = Quantity("millicores", {"m": 1}, "whole millicores, e.g. 500 or 500m (a core is 1000m)")
MIB = Quantity("MiB", {"Mi": 1, "Gi": 1024}, "whole MiB or GiB, e.g. 1536, 1536Mi or 2Gi")


# What every --nats help adds: the sign-ins read from the environment (`events.natsauth.env_sign_in`).
SIGN_IN_ENV_HELP = (" Without credentials in the URL: $NATS_USER/$NATS_PASSWORD or $NATS_TOKEN; a JWT "
                    "credentials file in $NATS_CREDS.")

NKEY_SEED_META = "warmboot.nkey_seed"  # where --nkey-seed keeps its file for `ask` (ctx.meta)
CONNECT_TIMEOUT_META = "warmboot.connect_timeout"  # where --connect-timeout keeps its seconds for `ask`
CONNECT_TIMEOUT_ENV = "WARMBOOT_CONNECT_TIMEOUT"
CONNECT_TIMEOUT_MAX_S = 3600.0


def check_nkey_seed_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--nkey-seed (or $NATS_NKEY_SEED) as a usage error unless its file holds an nkey seed
    (`events.natsauth.nkey_seed_problem`)."""
    if value is not None:
        problem = nkey_seed_problem(value)
        if problem is not None:
            raise click.BadParameter(problem, ctx=ctx, param=param)
    return value


def _keep_nkey_seed(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if check_nkey_seed_option(ctx, param, value) is not None:
        ctx.meta[NKEY_SEED_META] = value


def _keep_connect_timeout(ctx: click.Context, param: click.Parameter, value: float) -> None:
    """--connect-timeout (or $WARMBOOT_CONNECT_TIMEOUT), kept for `ask`: a number of seconds, more than 0 and
    at most CONNECT_TIMEOUT_MAX_S (a range lets NaN through)."""
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a number of seconds", ctx=ctx, param=param)
    ctx.meta[CONNECT_TIMEOUT_META] = value


def nats_option(command: Callable) -> Callable:
    """`--nats`, `--nkey-seed` (`$NATS_NKEY_SEED`) and `--connect-timeout` (`$WARMBOOT_CONNECT_TIMEOUT`), as a
    one-shot command connects and signs in (`ask`)."""
    command = click.option(
        "--connect-timeout", type=FloatRange(0, CONNECT_TIMEOUT_MAX_S, min_open=True),
        default=CONNECT_TIMEOUT_S, show_default=True, envvar=CONNECT_TIMEOUT_ENV, show_envvar=True,
        expose_value=False, callback=_keep_connect_timeout, metavar="SECONDS",
        help="How long to wait for the NATS server (it may be restarting) before giving up: UNAVAILABLE, "
             "exit 1.")(command)
    command = click.option(
        "--nkey-seed", type=click.Path(exists=True, dir_okay=False), default=None, envvar=NKEY_SEED_ENV,
        show_envvar=True, expose_value=False, callback=_keep_nkey_seed,
        help="Sign in with the nkey seed in this file (warmboot nats-config --auth nkey); replies are heard "
             "under _INBOX.<user>, the user the file's name gives (<user>.nk, as nats-config --seeds-dir "
             "names it), else give the user's inbox prefix in $NATS_INBOX_PREFIX.")(command)
    return click.option("--nats", "nats_url", default="nats://127.0.0.1:4222", show_default=True,
                        envvar="NATS_URL", show_envvar=True, callback=check_nats_option,
                        help="NATS server URL(s), comma-separated." + SIGN_IN_ENV_HELP)(command)
event_loop_option = click.option(
    "--event-loop", type=click.Choice(EVENT_LOOPS), default=None, envvar=EVENT_LOOP_ENV, show_envvar=True,
    help="The services' event loop: uvloop (the default where it is installed: less CPU per request), "
         "or asyncio's own.")
def json_option(command: Callable) -> Callable:
    """`--json`, and `-o json` as the views spell it (`cmd_views.output_option`): one flag, `as_json`."""

    def keep(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
        return value or ctx.params.get("as_json", False)  # -o json may have come first

    def output(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
        if value == "json":
            ctx.params["as_json"] = True

    command = click.option("--json", "as_json", is_flag=True, callback=keep,
                           help="Print JSON instead of text (the same as -o json).")(command)
    return click.option("-o", "--output", type=click.Choice(["json"]), expose_value=False, callback=output,
                        help="json: print JSON instead of text.")(command)
min_seq_option = click.option(
    "--min-seq", "min_seq", type=IntRange(min=1), default=None, metavar="SEQ",
    help="Answered from the scheduler's state once it includes stream sequence SEQ (the seq an earlier "
         "command printed): read-your-writes across commands; UNAVAILABLE if no replica has it in time.")


class OneOrMore(click.Argument):
    """An argument given one or more times (`nargs=-1`): `ACTOR_ID...` in the usage line, as click's own
    convention says it, while an error names it as one (`Invalid value for 'ACTOR_ID'`)."""

    def get_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [f"{self.make_metavar(ctx)}..."]


def check_id(ctx: click.Context | None, param: click.Parameter | None, value):
    """click callback: every value is an id (one NATS subject token), else a usage error naming the
    parameter (exit status 2, nothing sent)."""
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if v is not None and not ID_RE.match(v):
            raise click.BadParameter(f"{v!r} is not an id: {ID_WORDS}", ctx=ctx, param=param)
    return value


# the arguments that are ids: an entity's (a subject token each), and `actor tag`'s TAG and `actor
# update-template`'s TEMPLATE_UID, ids of the request's body (`events.schema.Id`) that a server refused only
# once it answered, INVALID_ARGUMENT naming neither argument, and with no server as UNAVAILABLE (a user trial)
ID_ARGUMENTS = ("actor_id", "worker_id", "tag", "template_uid")


def check_id_arguments(ctx: click.Context | None) -> None:
    """The running command's ACTOR_ID or WORKER_ID argument (and TAG, TEMPLATE_UID) is an id (`check_id`),
    else a usage error naming it, exit status 2, before anything is sent: the rule of every command that takes an id
    (`worker show 'bad id'` was a usage error, `explain 'bad id'` an INVALID_ARGUMENT from the
    client, exit 1, and only once the server answered: a walkthrough). `ask` checks it of every
    command, so that one whose argument has no `check_id` callback keeps the rule too."""
    if ctx is None:
        return
    for param in ctx.command.params:
        if isinstance(param, click.Argument) and param.name in ID_ARGUMENTS:
            check_id(ctx, param, ctx.params.get(param.name))


def selectors_of(pairs: tuple[str, ...]) -> dict[str, str]:
    """`--selector KEY=VALUE`, repeated, as a map; a key given twice is refused (one would be
    dropped without a word: a walkthrough's `--selector zone=a --selector zone=b` kept only b)."""
    selectors: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="'--selector'")
        if key in selectors:
            raise click.BadParameter(f"{key!r} is given twice ({selectors[key]!r} and {value!r}); a worker label "
                                     "has one value", param_hint="'--selector'")
        selectors[key] = value
    return selectors


# msgspec's refusal of a pattern, as `events.codec` words it: "Expected an id: ...; got 'bad id'"
_PATTERN_REFUSED = re.compile(r"Expected (?P<words>.+?); got (?P<got>.+)", re.S)


def in_words(message: str) -> str:
    """A request's refusal of a value as a usage error says it: a pattern not matched as `check_id` says an
    id that is not one (`'bad id' is not an id: 1 to 128 ...`), in the schema's words for the pattern
    (`events.schema.PATTERN_WORDS`); any other refusal as the service words it."""
    refused = _PATTERN_REFUSED.fullmatch(message)
    if refused is not None and refused["words"] in PATTERN_WORDS.values():
        return f"{refused['got']} is not {refused['words']}"
    return message


def _bare(info: Any) -> Any:
    """A field's msgspec type without its constraints and without None (an optional field's)."""
    while True:
        if isinstance(info, msgspec.inspect.Metadata):
            info = info.type
        elif isinstance(info, msgspec.inspect.UnionType):
            info = next(t for t in info.types if not isinstance(t, msgspec.inspect.NoneType))
        else:
            return info


def request_field(request: type, field: str, **others: Any) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """click callback of an option (or argument) whose value is `field` of a request of type `request`
    (`others`: the request's other required fields, any valid value): the value is decoded as the
    service decodes that request (`events.codec.decode_request`: the schema's patterns, lengths and bounds,
    and the rules of `events.validate` on the request), else a usage error naming the option, exit status
    2, before anything is sent, in the schema's words (`in_words`); the schema stays the one definition.
    Such values were refused only once the service answered, exit 1 (`--reason` over 256 characters,
    `actor create --class Gvisor`). A repeated option: each value (quoted where the refusal
    does not quote it), then, for a list field, all of them without repeats (as a command sends them); for
    a map field (`--selector KEY=VALUE`), each pair as a map of one (its key named), then the map
    (`selectors_of`), counted."""
    info = _bare(next(f.type for f in msgspec.inspect.type_info(request).fields if f.name == field))
    many = isinstance(info, (msgspec.inspect.ListType, msgspec.inspect.VarTupleType))
    mapped = isinstance(info, msgspec.inspect.DictType)

    def decode(value: Any) -> None:
        decode_request(request, encode({**others, field: value}))

    def check(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None or value == ():
            return value
        values = value if isinstance(value, tuple) else (value,)
        try:
            for one in values:
                try:
                    if mapped:
                        key, _, item = one.partition("=")
                        decode({key: item})
                    else:
                        decode([one] if many else one)
                except ContractError as e:
                    said = e.message
                    if mapped and " (in a key); got " in said and said.startswith("Expected "):
                        said = said.replace(" (in a key)", "", 1)  # the key, as a value is said
                    elif mapped:  # a map's value (quoted by `decode_request`), named by its key as given
                        said = f"selector {key!r}: {in_words(said)}"
                    elif len(values) > 1 and repr(one)[:GIVEN_CHARS] not in said:  # which value of several
                        said = f"{quoted(one)}: {said}"
                    raise click.BadParameter(in_words(said), ctx=ctx, param=param) from None
            whole = selectors_of(values) if mapped else list(dict.fromkeys(values)) if many else None
            if whole is not None:  # how many (a filter's values, without repeats; a map's keys)
                decode(whole)
        except ContractError as e:
            raise click.BadParameter(f"{in_words(e.message)} ({len(whole)} given)", ctx=ctx, param=param) from None
        return value

    return check


def check_prefix_option(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """click callback: a valid subject prefix."""
    try:
        return check_prefix(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


prefix_option = click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, envvar="WARMBOOT_PREFIX",
                             show_envvar=True, callback=check_prefix_option, help="Subject prefix of the deployment.")


# A request's fields that an option of another name gives (by its parameter's name); any other
# field is given by the option named as its first name (`selectors.zone`: `selectors`, --selector).
OPTION_OF_FIELD = {"resources.cpu_millis": "cpu_millis", "resources.memory_mib": "memory_mib",
                   "golden_snapshot": "golden"}


def flag_of(field: str | None) -> str | None:
    """The running command's option that gave a request's `field` (`resources.cpu_millis`:
    `--cpu`; `golden_snapshot.uri`: `--golden-snapshot`), if one did."""
    context = click.get_current_context(silent=True)
    if not field or context is None:
        return None
    path = re.sub(r"\[.*?\]", "", field)
    first = path.split(".")[0]
    name = OPTION_OF_FIELD.get(path) or OPTION_OF_FIELD.get(first, first)
    options = {p.name: p for p in context.command.params if isinstance(p, click.Option) and p.opts}
    return max(options[name].opts, key=len) if name in options else None  # --min-fidelity, not -m


class Failed(click.ClickException):
    """A contract error as every command prints it: `error: CODE field: message` on stderr, exit 1."""

    def __init__(self, error: ContractError, held: list[str] | None = None):
        """`held`: the prefixes whose logs the server holds (`prefixes_held`), if they could be read:
        a request nobody answered then says whether the prefix is wrong or its service is not running.
        A request's UNAVAILABLE that some attempt of it met at a service (a time-out, a service's
        own) names its request id (`ContractError.request_id`, which the client gives it), since the
        request may have been carried out, and that id, sent again, gets its answer (a new one asks
        anew: a pause so repeated was refused, the actor being PAUSED by the first)."""
        where = f" {error.field}" if error.field else ""
        flag = flag_of(error.field)
        if flag:  # the wire's name, and what the user typed
            where += f" ({flag})"
        hint = ""
        message = error.message
        context = click.get_current_context(silent=True)
        prefix = context.params.get("prefix") if context is not None else None
        # the subject's second word, in "no service answers <prefix>.<service>...": the service asked
        service = (message[len(NO_SERVICE):].split(" ")[0].split(".")[1:2] or ["service"])[0]
        heard = not (message.startswith(NO_SERVICE) and message.endswith(no_service_hint(prefix or "", service)))
        if heard and error.request_id and error.code is ErrorCode.UNAVAILABLE and not past_the_end(error):
            hint = (f" (it may have been carried out: run the command again with --request-id {error.request_id} "
                    "for its answer; a new request id would ask anew)")
        if prefix and not heard:
            # none of the attempts reached a service, as `last_seq` says it for the log
            message = message.removesuffix(no_service_hint(prefix, service))  # the client's, said here as an option
            if held and prefix in held:
                hint = f" (the log of --prefix {prefix} is on this server: does the {service} run?)"
            elif held:
                hint = f" (is --prefix {prefix} the deployment's? {logs_held(held)})"
            else:
                hint = f" (is --prefix {prefix} the deployment's, and does the {service} run?)"
        super().__init__(f"{error.code.value}{where}: {message}{hint}")
        self.error = error

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.message}", file=file, err=True)


# A one-shot command waits up to CONNECT_TIMEOUT_S (--connect-timeout) for its server (it may be restarting); past
# this it says, on a terminal's standard error, that it is waiting and why.
WAITING_NOTE_S = 1.0


def stderr_is_terminal() -> bool:
    """Whether progress may be shown: on a terminal, not in a pipe or a log a script reads."""
    return sys.stderr.isatty()


def ask(nats_url: str, work: Callable[[Any], Awaitable[Any]]) -> Any:
    """Connect, run `work(nc)`, close (given up after CLOSE_GIVEN_UP_S: `close_within`); contract errors and connection failures become CLI errors
    (`Failed`: `error: CODE field: message`, exit 1). A malformed ACTOR_ID or WORKER_ID argument is a
    usage error first (`check_id_arguments`). A server that has not answered within
    WAITING_NOTE_S is said to be waited for, on a terminal, with the last error."""

    ctx = click.get_current_context(silent=True)
    check_id_arguments(ctx)  # a malformed ACTOR_ID, WORKER_ID, TAG or TEMPLATE_UID: a usage error, before connecting
    seed = ctx.meta.get(NKEY_SEED_META) if ctx is not None else None  # --nkey-seed (else $NATS_NKEY_SEED)
    within = ctx.meta.get(CONNECT_TIMEOUT_META, CONNECT_TIMEOUT_S) if ctx is not None else CONNECT_TIMEOUT_S

    async def run() -> Any:
        errors = ErrorsOnce(None)

        def waiting() -> None:
            why = describe_error(errors.last) if errors.last is not None else "no answer yet"
            click.echo(f"waiting up to {within:g} s for NATS at {redact_url(nats_url)} ({why})", err=True)

        note = asyncio.get_running_loop().call_later(WAITING_NOTE_S, waiting) if stderr_is_terminal() else None
        try:
            nc = await connect_within(nats_url, "warmboot-cli", within, errors=errors, nkey_seed=seed)
        finally:
            if note is not None:
                note.cancel()
        try:
            await hears_replies(nats_url, nc, errors)  # a user refused its inbox: said before anything is sent
        except BaseException:
            await close_within(nc)  # its server gone too, or frozen (nats-py's own close never ends then)
            raise
        try:
            return await work(nc)
        except ContractError as e:
            # a wrong prefix, or a service not running: which one
            held = await prefixes_held(nc) if e.message.startswith(NO_SERVICE) else None
            raise Failed(e, held) from None
        finally:
            await close_within(nc)  # its server gone too, or frozen (nats-py's own close never ends then)

    try:
        return asyncio.run(run())
    except ContractError as e:
        raise Failed(e) from None


def version_text(version: Any) -> str:
    return describe_key(compat_key("", version)).strip()


class LogUnreadable(click.ClickException):
    """`last_seq`'s error: the log cannot be read. Its message is the whole story, for a command
    that fails with it; `why` says it in a few words, for a command that goes on without the log
    and says in one line what it did not look up (`cmd_views.readable_fleet`)."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why


REFUSED_THE_LOG = "these credentials may not read the log"  # `LogUnreadable.why` for a refused question


def unread_why(error: BaseException) -> str:
    """Why a read of the log that a command goes on without failed, in a few words for a note: a
    LogUnreadable's `why` (`these credentials may not read the log`), else the error's message.
    One wording for every such note (a trial: `actor tag` and `actor create --source-tag` gave a
    client the four lines of the log's error, asking whether the credentials may read it, where the
    other notes said it in one)."""
    if isinstance(error, LogUnreadable):
        return error.why
    if isinstance(error, (click.ClickException, ContractError)):
        return error.message
    return describe_error(error)


async def last_seq(nc: Any, prefix: str, timeout: float = 5.0) -> int:
    """The event stream's last sequence as its leader has it, or LogUnreadable (a ClickException):
    "try again" while the stream has no leader; NOT_FOUND (field `prefix`) when the server has no
    such stream, naming the prefixes whose logs it holds; else naming the stream, the prefix and the
    credentials (a client's may not ask: NATS refuses the question, said as soon as the server says
    so, `unless_refused`; `timeout` bounds the wait for an answer otherwise)."""
    stream = stream_name(prefix)
    try:
        asked = leaders_stream_info(nc.jetstream(timeout=timeout), stream)
        return (await unless_refused(nc, f"$JS.API.STREAM.INFO.{stream}", asked)).state.last_seq
    except nats.js.errors.ServiceUnavailableError:  # asked right, answered "not now": no hint about the prefix
        raise LogUnreadable(f"cannot read the event stream {stream_name(prefix)} now: it has no leader (an "
                            "election, or too few of its servers up); try again",
                            f"the event stream {stream} has no leader now") from None
    except nats.js.errors.NotFoundError:  # the server says there is no such stream: not a question of credentials
        held = await prefixes_held(nc)
        here = (f" ({logs_held(held)})" if held else " (no warmboot log here: its services make one when they "
                "first start)" if held is not None else "")
        raise not_found(f"no event stream {stream_name(prefix)} on this server: is --prefix {prefix} the "
                        f"deployment's?{here}", "prefix") from None
    except Exception as e:
        refused = isinstance(e, PublishRefused)  # the server said so: not a question of the prefix
        if refused:  # (it asked whether --prefix was the deployment's: a trial of a client's `whatif`)
            message = (f"cannot read the event stream {stream_name(prefix)}: {REFUSED_THE_LOG} (the server refused "
                       f"it: {describe_error(e)}). A client's may not; an operator's may (docs/security.md, Roles)")
        else:
            message = (f"cannot read the event stream {stream_name(prefix)} ({describe_error(e)}): is --prefix "
                       f"{prefix} the deployment's, and may these credentials read its log? (a client's may not: "
                       "docs/security.md)")
        raise LogUnreadable(message, REFUSED_THE_LOG if refused else
                            f"the event stream {stream} cannot be read: {describe_error(e)}") from None


PREFIXES_SHOWN = 5  # of the logs a server holds, named in the error about another prefix


async def prefixes_held(nc: Any, timeout: float = 1.0) -> list[str] | None:
    """The prefixes of the warmboot logs this server holds (a stream `<PREFIX>_EVENTS` on
    `<prefix>.ev.>`), for a hint; None if the streams cannot be listed within `timeout` (an
    operator's credentials may not list them, docs/security.md: NATS then answers nothing, and the
    error waits that long; a server answers in milliseconds)."""
    async def every_page() -> list[Any]:  # the server lists 256 streams a page
        infos: list[Any] = []
        while True:
            page = await nc.jetstream().streams_info_iterator(offset=len(infos))
            got = list(page)
            infos += got
            if not got or len(infos) >= page.total:
                return infos

    try:
        infos = await asyncio.wait_for(every_page(), timeout)
    except Exception:
        return None
    held = set()
    for info in infos:
        for subject in info.config.subjects or ():
            found = re.fullmatch(r"(.+)\.ev\.>", subject)
            if found and PREFIX_PATTERN.match(found[1]) and info.config.name == stream_name(found[1]):
                held.add(found[1])
    return sorted(held)


def logs_held(held: list[str]) -> str:
    """The logs a server holds, as an error about another prefix names them."""
    more = f" and {len(held) - PREFIXES_SHOWN} more" if len(held) > PREFIXES_SHOWN else ""
    return f"logs here: --prefix {', '.join(held[:PREFIXES_SHOWN])}{more}"


# How long one batched direct get may take (the server answers a page in milliseconds; the
# bound only ends a read of a server that went away), and how often a read that ended before
# the position it was asked to reach is asked again.
READ_TIMEOUT_S = 30.0
READ_ATTEMPTS = 10


async def log_messages(nc: Any, prefix: str, filter_subject: str | None = None,
                       stop: int | None = None) -> AsyncIterator[tuple[int, str, dict[str, str], bytes]]:
    """The stream's messages on `filter_subject` (all of them by default) up to `stop`, as
    (sequence, subject, headers, body), in order, by batched direct gets: the only way an
    operator's credential may read the log (no consumer: docs/security.md, Operators). The
    headers are those a fold reads (sequence, subject, topic, version), not every line of each answer.

    Any replica of the stream answers a direct get, and one that lags ends its batch early:
    a read that ends before `stop` asks again (up to READ_ATTEMPTS times) from where it is."""
    from events.jetstream.layout import SEQUENCE_HEADER, SUBJECT_HEADER, TOPIC_HEADER, VERSION_HEADER
    from events.jetstream.link import direct_batch
    from events.jetstream.stream import READ_PAGE
    from events.natspy.headers import use_lean_headers

    use_lean_headers(nc)  # each answer carries its message's headers and the direct get's own
    stream = stream_name(prefix)
    seq = 1
    short = 0
    while stop is None or seq <= stop:
        request: dict[str, Any] = {"seq": seq, "batch": READ_PAGE}
        if filter_subject is not None:
            request["next_by_subj"] = filter_subject
        try:
            page, pending = await direct_batch(nc, stream, request, READ_TIMEOUT_S,
                                               (SEQUENCE_HEADER, SUBJECT_HEADER, TOPIC_HEADER, VERSION_HEADER))
        except Exception as e:
            raise click.ClickException(f"reading the event stream {stream} from sequence {seq} failed: "
                                       f"{type(e).__name__}: {e}") from None
        for msg in page:
            headers = msg.headers or {}
            msg_seq = int(headers[SEQUENCE_HEADER])
            if stop is not None and msg_seq > stop:
                return
            yield msg_seq, headers.get(SUBJECT_HEADER, ""), headers, msg.data
            seq = msg_seq + 1
        if page and pending:
            continue
        if stop is None or seq > stop or not await _more_at_leader(nc, stream, seq, stop, filter_subject):
            return
        short += 1  # a replica behind the leader ended the batch early
        if short >= READ_ATTEMPTS:
            raise click.ClickException(f"the event stream {stream}'s replicas served messages up to {seq - 1}, "
                                       f"its leader has more up to {stop}; try again")
        await asyncio.sleep(0.1 * short)  # a back-off between attempts, not a wait for an event


async def _more_at_leader(nc: Any, stream: str, seq: int, stop: int, filter_subject: str | None) -> bool:
    """Whether the stream leader has a message on `filter_subject` from `seq` up to `stop`."""
    import nats.js.errors

    try:
        found = await nc.jetstream().get_msg(stream, seq=seq, subject=filter_subject or ">", next=True)
    except nats.js.errors.NotFoundError:
        return False
    except Exception as e:
        raise click.ClickException(f"reading the event stream {stream} at sequence {seq} failed: "
                                   f"{type(e).__name__}: {e}") from None
    return found.seq <= stop


PROGRESS_EVERY = 1000  # messages folded between two updates of a replay's progress bar


async def replay(nc: Any, prefix: str, sink: Any, show_progress: bool) -> Any:
    """Fold the stream (as it is now) into `sink` with the scheduler's own reading of each
    message (`Fold.fold_message`), with a progress bar on stderr; read only until the sink's
    bound is passed (`stopped_at`: `audit replay --until`, `--until-time`), not to the log's end."""
    from services.scheduler.fold import Fold

    target = await last_seq(nc, prefix)
    progress = Progress(TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True,
                        disable=not (show_progress and stderr_is_terminal()))  # no stray line in a pipe
    with progress:
        task = progress.add_task("", total=target)
        fold = Fold(nc, prefix, sink)
        shown = 0
        async for seq, subject, headers, data in log_messages(nc, prefix, stop=target):
            fold.fold_message(seq, subject, headers, data)
            if seq - shown >= PROGRESS_EVERY:  # not at every message: an update costs a tenth of a fold's
                progress.update(task, completed=seq)
                shown = seq
            if sink.stopped_at is not None:  # past its bound (`audit.Sink`): nothing later is folded
                break
        progress.update(task, completed=target)
    return sink


async def replay_for(nc: Any, prefix: str, endpoint: str, sink: Any, show_progress: bool) -> Any:
    """`replay`, for a view whose scheduler endpoint (`scheduler.workers`, ...) nobody answered: where
    the log cannot be read either, the error says both, the scheduler first (a trial of the docs: a
    client's `workers` with no scheduler running said only that its credentials may not read the log,
    and asked whether --prefix was the deployment's)."""
    try:
        return await replay(nc, prefix, sink, show_progress)
    except LogUnreadable as e:
        raise LogUnreadable(f"no scheduler answers {prefix}.scheduler.{endpoint} (does the scheduler run?), and "
                            f"the log cannot be folded here in its place: {e.why}", e.why) from None


async def read_subject(nc: Any, prefix: str, subject: str) -> list[tuple[int, Any]]:
    """Every event on one subject of the stream, as (stream sequence, event), in order.
    FAILED_PRECONDITION naming the first message this version cannot read (a newer version's
    event, whose topic and schema version it names; or not an event at all), not a traceback."""
    import msgspec

    from events.codec import decode_event
    from events.errors import precondition
    from events.jetstream.layout import TOPIC_HEADER, VERSION_HEADER

    target = await last_seq(nc, prefix)
    events = []
    async for seq, _, headers, data in log_messages(nc, prefix, subject, target):
        try:
            events.append((seq, decode_event(data)))
        except msgspec.DecodeError as e:  # a ValidationError is one
            topic = headers.get(TOPIC_HEADER, "no topic")
            version = headers.get(VERSION_HEADER)
            raise precondition(
                f"message {seq} of {subject} ({topic}{f', version {version}' if version else ''}) is not an event "
                f"this version of warmboot reads ({e}): a newer warmboot may read it") from None
    return events

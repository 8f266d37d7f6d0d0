"""Where a LOCAL image can be loaded: a *place*, the disk of a node (CONTRACT rule 5, with the node
tokens of docs/contract.md). Pure: no I/O.

A LOCAL image is on the disk of the machine that took it. A node name alone does not say which
disk that is: a machine replaced under the old name (its disk wiped, or a new one) would be sent
the old disk's images, which cannot load there. A worker may therefore register a `node_token`,
kept on its node's own disk (warmboot's agent: `--node-token-file`), and the scheduler's fold
keys everything rule 5 reads by place, not by node:

- a worker's place is its node when it registers the first token its node ever registered
  (the disk the node had before tokens, an agent upgraded in place: its earlier images stay
  restorable), or none while the node has registered no other token since its first, and
  `<node>/<token>` for any other token (another disk). A registration without a token on a node
  that has registered another disk since its first (a machine replaced) cannot say which disk it
  is on: its place is its own, `<node>//<worker id>@<sequence>`, which no image of another
  registration is on (the registry refuses it of a worker that gave a token before);
- a LOCAL image's place is the place of the worker it was taken on (the actor's placement when
  the pause is folded); one whose node is not where the actor ran is on a disk the fold does not
  know: `<node>/` when the node has registered a token (no worker is there: lost), its node
  otherwise (as before tokens);
- a PAUSED actor is pinned to its image's place.

'/' is in no id (CONTRACT section 2), so a place is never a node's name, and the node is what
comes before it. The node's first and latest other tokens (`Disks`) are folded from registrations in
stream order, so every replica, and `audit verify`, finds the same places.
"""

from __future__ import annotations

SEP = "/"


class Disks(dict[str, tuple[str, str]]):
    """node -> (the first node token it registered, the latest other one: the first while it has registered
    no other), of nodes that registered one. The first registered again does not take the latest back: the
    node has moved on from its first disk all the same (another machine under its name), and a registration
    without a token there still cannot say which disk it is on."""

    def place(self, node: str, token: str | None, registration: str) -> str:
        """The place of a worker registering `token` on `node`, the tokens it names recorded;
        `registration` names the registration (`<worker id>@<sequence>`), the place of one without
        a token on a node that has moved on from its first disk."""
        if token is None:
            tokens = self.get(node)
            return node if tokens is None or tokens[0] == tokens[1] else f"{node}{SEP}{SEP}{registration}"
        first, latest = self.get(node, (token, token))
        self[node] = (first, latest if token == first else token)
        return node if token == first else f"{node}{SEP}{token}"

    def unknown(self, node: str) -> str:
        """The place of a LOCAL image on `node` not taken where the actor ran: a disk the fold does not
        know when the node registers tokens (no worker is on it), else the node (as before tokens)."""
        return f"{node}{SEP}" if node in self else node

    def moved_on(self, place: str) -> bool:
        """Whether `place`'s node has registered another disk's token since the one `place` is of: a
        machine replaced, and a LOCAL image there lost for good."""
        node, _, token = place.partition(SEP)
        tokens = self.get(node)
        if tokens is None:
            return False
        first, latest = tokens
        return (token or first) != latest


def node_of(place: str) -> str:
    """The node a place is a disk of."""
    return place.partition(SEP)[0]


def describe(place: str) -> str:
    """A place as messages say it: `node N`, or `node N (the disk of node token T)`."""
    return f"node {short(place)}"


def short(place: str) -> str:
    """A place as a message names it after "on": `N`, or `N (the disk of node token T)`."""
    node, sep, token = place.partition(SEP)
    if not sep:
        return node
    if not token:
        return f"{node} (a disk of it that no registration names)"
    if token.startswith(SEP):
        return f"{node} (a disk that no node token names: the registration {token[1:]})"
    return f"{node} (the disk of node token {token})"

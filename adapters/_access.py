"""Access control: who may read or write which thread, decided before anything is touched."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal, Protocol

import msgspec

from eventstore import EventStoreError, InvalidInputError

Action = Literal["read", "write"]


class AccessDenied(EventStoreError, PermissionError):
    """Raised when the access policy refuses a principal an action on a thread (``reason``:
    what the policy allows instead, when it says)."""

    def __init__(
        self,
        principal: Principal | None,
        action: Action,
        thread_id: str | None,
        reason: str | None = None,
    ) -> None:
        self.principal = principal
        self.action = action
        self.thread_id = thread_id
        self.reason = reason
        who = principal.id if principal is not None else "anonymous caller"
        where = f"thread {thread_id!r}" if thread_id is not None else "the namespace"
        super().__init__(f"{who} may not {action} {where}" + (f": {reason}" if reason else ""))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.principal, self.action, self.thread_id, self.reason))


class Principal(msgspec.Struct, frozen=True, kw_only=True):
    """Who is calling: an id, the tenant (namespace) they belong to, and free-form roles."""

    id: str
    tenant: str | None = None
    roles: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.id, str):
            raise InvalidInputError(f"principal id must be a str, not {self.id!r:.60}")
        if self.tenant is not None and not isinstance(self.tenant, str):
            raise InvalidInputError(
                f"principal tenant must be a str or None, not {self.tenant!r:.60}"
            )
        roles: object = self.roles
        # A str of roles would be searched as text: "admin" in "not-an-admin" is True.
        if isinstance(roles, str | bytes) or not isinstance(roles, Iterable):
            raise InvalidInputError(
                f"principal roles must be a set of role names, not {type(roles).__name__}: "
                f"{roles!r:.60}"
            )
        listed = list(roles)
        if not all(isinstance(r, str) for r in listed):
            raise InvalidInputError(f"principal roles must be str, not {listed!r:.60}")
        names = frozenset(listed)
        msgspec.structs.force_setattr(self, "roles", names)


class AccessPolicy(Protocol):
    """Decides whether ``principal`` may ``action`` a thread (None: the whole namespace).

    A session or thread id is never proof of access: policies decide from the principal.
    """

    async def allows(
        self, principal: Principal | None, action: Action, namespace: str, thread_id: str | None
    ) -> bool: ...


class ReaderViewPolicy(Protocol):
    """What a policy may add to `AccessPolicy`: the reader view a principal must read a
    thread's state through (`ThreadStore.state` and `context`).

    A reader view selects the blocks and fields a reader sees; a policy with this method makes
    that a boundary: a principal it names a view for gets `AccessDenied` when it asks for
    another view, or for every block (``view=None``). None: any view, or none.
    """

    async def reader_view(
        self, principal: Principal | None, namespace: str, thread_id: str
    ) -> str | None: ...


class AllowAll:
    """The default policy: everything within the store's namespace is allowed."""

    async def allows(
        self, principal: Principal | None, action: Action, namespace: str, thread_id: str | None
    ) -> bool:
        return True


class TenantPolicy:
    """Namespaces are tenants: a principal reaches only its own tenant's namespace.

    Calls without a principal are refused. ``admin_role`` (if set) reaches every tenant.
    """

    def __init__(self, *, admin_role: str | None = None) -> None:
        if admin_role is not None and not isinstance(admin_role, str):
            raise InvalidInputError(f"admin_role must be a str or None, not {admin_role!r:.60}")
        self.admin_role = admin_role

    async def allows(
        self, principal: Principal | None, action: Action, namespace: str, thread_id: str | None
    ) -> bool:
        if principal is None:
            return False
        if self.admin_role is not None and self.admin_role in principal.roles:
            return True
        return principal.tenant == namespace


class CallbackPolicy:
    """A policy from a function ``(principal, action, namespace, thread_id) -> bool``, and
    optionally one ``(principal, namespace, thread_id) -> view name | None`` that confines
    state reads to a reader view (`ReaderViewPolicy`)."""

    def __init__(
        self,
        decide: Callable[[Principal | None, Action, str, str | None], Awaitable[bool] | bool],
        *,
        reader_view: Callable[[Principal | None, str, str], Awaitable[str | None] | str | None]
        | None = None,
    ) -> None:
        if not callable(decide):
            raise InvalidInputError(
                f"decide must be a function (principal, action, namespace, thread_id) -> bool, "
                f"not {decide!r:.60}"
            )
        if reader_view is not None and not callable(reader_view):
            raise InvalidInputError(
                "reader_view must be a function (principal, namespace, thread_id) -> view name "
                f"or None, not {reader_view!r:.60}"
            )
        self._decide = decide
        self._reader_view = reader_view

    async def reader_view(
        self, principal: Principal | None, namespace: str, thread_id: str
    ) -> str | None:
        if self._reader_view is None:
            return None
        view = self._reader_view(principal, namespace, thread_id)
        if inspect.isawaitable(view):
            view = await view
        return view

    async def allows(
        self, principal: Principal | None, action: Action, namespace: str, thread_id: str | None
    ) -> bool:
        verdict = self._decide(principal, action, namespace, thread_id)
        if inspect.isawaitable(verdict):
            verdict = await verdict
        return verdict is True  # a callback that forgets to return (None) denies: fail closed


def check_policy(policy: object) -> AccessPolicy:
    """The policy a store is to ask: `AllowAll` for None (`is None`, not falsiness: a falsy
    policy, an empty rule table, decides like any other), ``policy`` if it can be asked (an
    ``allows`` method), else `InvalidInputError`: a store built with something else would
    fail on every call."""
    if policy is None:
        return AllowAll()
    if isinstance(policy, type) or not callable(getattr(policy, "allows", None)):
        raise InvalidInputError(
            "policy must be an AccessPolicy (an object with an async allows(principal, action, "
            f"namespace, thread_id) method), not {type(policy).__name__}: {policy!r:.60}"
        )
    return policy  # type: ignore[return-value]


async def authorize(
    policy: AccessPolicy,
    principal: Principal | None,
    action: Action,
    namespace: str,
    thread_id: str | None,
) -> None:
    """Raise `AccessDenied` unless ``policy`` allows the call (`InvalidInputError` for a
    ``principal`` that is neither a `Principal` nor None)."""
    _check_principal(principal)
    # Only True allows: a policy that returns None or another truthy value by mistake denies.
    if await policy.allows(principal, action, namespace, thread_id) is not True:
        raise AccessDenied(principal, action, thread_id)


def _check_principal(principal: object) -> None:
    # A policy reads the principal's fields: a name or a dict in its place would make every
    # policy fail with an AttributeError, and the default one let the call through unnoticed.
    if principal is not None and not isinstance(principal, Principal):
        raise InvalidInputError(
            f"principal must be a Principal or None, not {type(principal).__name__}: "
            f"{principal!r:.80}"
        )


async def authorize_view(
    policy: AccessPolicy,
    principal: Principal | None,
    namespace: str,
    thread_id: str,
    view: str | None,
) -> None:
    """Raise `AccessDenied` unless ``view`` is the reader view the policy confines the
    principal's state reads to (any view when it names none, or has no `reader_view`)."""
    _check_principal(principal)
    confine = getattr(policy, "reader_view", None)
    if confine is None:
        return
    required = await confine(principal, namespace, thread_id)
    if required is not None and view != required:
        asked = "every block" if view is None else f"reader view {view!r}"
        raise AccessDenied(
            principal,
            "read",
            thread_id,
            f"its state only through reader view {required!r}, not {asked}",
        )

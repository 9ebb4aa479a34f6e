"""Access control: who may read or write which thread, decided before anything is touched."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Literal, Protocol

import msgspec

from eventstore import EventStoreError

Action = Literal["read", "write"]


class AccessDenied(EventStoreError, PermissionError):
    """Raised when the access policy refuses a principal an action on a thread."""

    def __init__(self, principal: Principal | None, action: Action, thread_id: str | None) -> None:
        self.principal = principal
        self.action = action
        self.thread_id = thread_id
        who = principal.id if principal is not None else "anonymous caller"
        where = f"thread {thread_id!r}" if thread_id is not None else "the namespace"
        super().__init__(f"{who} may not {action} {where}")


class Principal(msgspec.Struct, frozen=True, kw_only=True):
    """Who is calling: an id, the tenant (namespace) they belong to, and free-form roles."""

    id: str
    tenant: str | None = None
    roles: frozenset[str] = frozenset()


class AccessPolicy(Protocol):
    """Decides whether ``principal`` may ``action`` a thread (None: the whole namespace).

    A session or thread id is never proof of access: policies decide from the principal.
    """

    async def allows(
        self, principal: Principal | None, action: Action, namespace: str, thread_id: str | None
    ) -> bool: ...


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
    """A policy from a function ``(principal, action, namespace, thread_id) -> bool``."""

    def __init__(
        self, decide: Callable[[Principal | None, Action, str, str | None], Awaitable[bool] | bool]
    ) -> None:
        self._decide = decide

    async def allows(
        self, principal: Principal | None, action: Action, namespace: str, thread_id: str | None
    ) -> bool:
        verdict = self._decide(principal, action, namespace, thread_id)
        if inspect.isawaitable(verdict):
            verdict = await verdict
        return verdict is True  # a callback that forgets to return (None) denies: fail closed


async def authorize(
    policy: AccessPolicy,
    principal: Principal | None,
    action: Action,
    namespace: str,
    thread_id: str | None,
) -> None:
    """Raise `AccessDenied` unless ``policy`` allows the call."""
    # Only True allows: a policy that returns None or another truthy value by mistake denies.
    if await policy.allows(principal, action, namespace, thread_id) is not True:
        raise AccessDenied(principal, action, thread_id)

"""The gRPC Admin service (protos/pagedserve/v1/admin.proto): sleep, wake and weight updates on
every engine (frontend/sleep.py), as the HTTP admin routes do them.

The key: the frontend's --api-key in the `authorization: Bearer KEY` metadata. Missing or wrong:
UNAUTHENTICATED; a frontend started without a key refuses every call (PERMISSION_DENIED), as
the HTTP routes do (403). Errors map through `status_codes`, like every other service's.
"""

from __future__ import annotations

import hmac

import grpc

from common.v1 import admin_pb2, admin_pb2_grpc
from frontend.async_llm import AsyncLLM
from frontend.servicers import status_codes
from frontend.sleep import SleepState, sleep, sleep_state, update_weights, wake_up


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, llm: AsyncLLM, api_key: str | None) -> None:
        self.llm, self.api_key = llm, api_key

    async def Sleep(self, request: admin_pb2.SleepRequest, context) -> admin_pb2.SleepState:
        await self._check_key(context)
        async with status_codes(context):
            return _proto(await sleep(self.llm.pool, request.level or 1))

    async def WakeUp(self, request: admin_pb2.WakeUpRequest, context) -> admin_pb2.SleepState:
        await self._check_key(context)
        async with status_codes(context):
            return _proto(await wake_up(self.llm.pool))

    async def IsSleeping(self, request: admin_pb2.IsSleepingRequest, context) -> admin_pb2.SleepState:
        await self._check_key(context)
        return _proto(sleep_state(self.llm.pool))

    async def UpdateWeights(self, request: admin_pb2.UpdateWeightsRequest, context) -> admin_pb2.SleepState:
        await self._check_key(context)
        async with status_codes(context):
            return _proto(await update_weights(self.llm.pool, request.model_path))

    async def _check_key(self, context) -> None:
        if self.api_key is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "the Admin service needs the server started "
                                "with --api-key, then that key sent (authorization: Bearer KEY)")
        given = dict(context.invocation_metadata()).get("authorization", "")
        given = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key "
                                "(metadata authorization: Bearer KEY)")


def _proto(state: SleepState) -> admin_pb2.SleepState:
    return admin_pb2.SleepState(is_sleeping=state.is_sleeping, level=state.level)

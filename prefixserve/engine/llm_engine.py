"""The engine loop: one ``step`` = schedule -> assemble inputs -> launch on the runner -> update -> outputs.

Callers (the LLM API, the CLI, the server) drive an Engine through ``add_request``, ``abort`` and
``step``; the device side (inputs, forward, CUDA graphs, sampling) is the ``ModelRunner``'s. This
module owns the requests and the order of a step, as vLLM v1's ``EngineCore`` does; features sit at
the edges: intake (``input_processor``), step inputs (``step_inputs``), launch-ahead placeholders
(``in_flight``), token placing and stops (``Scheduler.update_from_output``), metrics (``stats``),
applications' system prompts (``system_prompts``); what a request asks beyond the sampler's params
(grammars, bans, budgets; prompt logprobs, embeddings) is its request and output rules', called once
per hook through ``self.rules`` and ``self.output_rules`` (assembled in ``request_rules``: this module
imports no rule); building it (runner, pool, scheduler, Prompt Cache, pinned prompts) is
``engine_setup``; what the engine offers besides the loop (device properties, schemas, pinned
prompts, metrics, cache events) is ``engine_services``; the Prompt Cache's store and device calls live
in ``promptcache/``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from prefixserve.engine.cache_pins import check_pins
from prefixserve.engine.engine_services import EngineServices
from prefixserve.engine.engine_setup import EngineSetup
from prefixserve.engine.in_flight import PLACEHOLDER_TOKEN, LaunchedStep, TakenTokens
from prefixserve.engine.output_processor import request_output
from prefixserve.engine.speculative import give_back, place_verified
from prefixserve.engine.step_inputs import assemble_batch, gather_token_ids, take_recompute_ids
from prefixserve.model.parallel import WorkerDiedError
from prefixserve.outputs import RequestOutput
from prefixserve.pooling_params import PoolingParams
from prefixserve.sampling.params import SamplingParams
from prefixserve.sampling.sampler import SampleResult
from prefixserve.scheduler.groups import GroupJob
from prefixserve.scheduler.policy import check_priority
from prefixserve.scheduler.scheduler import SchedulerOutput
from prefixserve.sequence import Request, SeqStatus, Sequence, token_array
from prefixserve.worker.model_runner import PrevTokenFeed, StepBatch

log = logging.getLogger(__name__)


class Engine(EngineSetup, EngineServices):
    """Requests in, RequestOutputs out, one batch per ``step``; the model runner does the device work
    (built by ``EngineSetup``)."""

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: Iterable[int] | None = None,
        prompt_positions: Iterable[int] | None = None,
        cache_salt: str | None = None,
        stream: bool = False,
        application: str | None = None,
        queue: bool = True,
        module_recompute: str | None = None,
        admit: Callable[[Request], None] | None = None,
        priority: int = 0,
        pooling: PoolingParams | None = None,
        public_tokens: int = 0,
        tenant: str | None = None,
        cache_pins: list[tuple[int, float]] | None = None,
    ) -> Request:
        """Validate and queue a request; raises ValueError naming the problem (nothing is queued then).

        ``application`` names a pinned system prompt: the prompt is put after it unless it already
        starts with it (a chat rendered with that system message). ``queue=False`` leaves the request
        for ``add_group`` (offline batches), which queues it as a member of a prefix-sharing group.
        ``module_recompute`` ("none", "link:K", "blend:R") overrides a PML prompt's recovery setting.
        ``admit``: a server's overload check (``serving/admission.py``), shown the processed request
        before it is queued; what it raises refuses the request, and nothing is queued then.
        ``priority``: under the ``priority`` scheduling policy, a smaller value is served first.
        ``pooling``: an embedding request (``params`` None): its output's ``embedding``, no completion.
        ``public_tokens``: with a ``cache_salt``, the prompt's first tokens (as run: an application's
        pinned prompt counted) that are public; blocks wholly inside them are shared across salts. A PML
        prompt runs its module rows first: public tokens covering them all make the schema's pieces
        public (``PromptModules.prepare``).
        ``tenant``: whose share the request draws on under the ``fair`` scheduling policy.
        ``cache_pins``: (prompt tokens, seconds) breakpoints whose blocks are held for that long once
        the request ends, within the pinned-block budget (``engine/cache_pins.py``).
        """
        check_priority(priority, self.config.scheduling_policy)
        if tenant is not None and not isinstance(tenant, str):
            raise ValueError(f"tenant must be a string, got {type(tenant).__name__}")
        pins = check_pins(cache_pins) if cache_pins is not None else []
        params = self.output_rules.prepare(params, pooling, prompt)  # an embedding's: one greedy token
        req = self.input_processor.process(  # the request rules check and admit it there
            request_id, prompt, params, prompt_token_ids, prompt_positions, cache_salt, stream,
            application, module_recompute, self.tokenizer, self.max_model_len, public_tokens,
            pooled=pooling is not None,
        )  # fmt: skip
        req.priority, req.tenant, req.cache_pins = priority, tenant, pins
        self.cache_pins.admit(req)  # breakpoints past the pinned-block budget are not honoured
        if admit is not None:
            try:
                admit(req)
            except BaseException:
                if req.modules is not None:  # the module blocks the intake took for it
                    self.modules.release(req.modules.blocks)
                raise
        if req.modules is not None and req.modules.recompute_runs:
            self._to_recover.add(req)
        self.output_rules.admit(req, pooling)
        self.requests[request_id] = req
        if queue:
            self.scheduler.add(req.sequences[0])
        self.counters["requests_total"] += 1
        held = req.modules
        self.counters["prompt_tokens_total"] += req.num_prompt_tokens - (held.holes if held else 0)
        if held is not None:
            self.counters["module_tokens_reused_total"] += held.reused_tokens
        return req

    def add_group(self, requests: list[Request], prefix_len: int) -> None:
        """Queue requests added with ``queue=False`` as one prefix-sharing group (BatchLLM): the first
        computes the shared ``prefix_len`` tokens, the group holds them until its last member ends."""
        seqs = [r.sequences[0] for r in requests]
        if any(s.status is not SeqStatus.WAITING or s.block_table for s in seqs):
            raise ValueError("add_group takes requests added with queue=False and not yet queued")
        self.scheduler.add_group(GroupJob(members=seqs, prefix_len=prefix_len))

    def abort(self, request_id: str, report: bool = True, reason: str = "abort") -> bool:
        """Stop a request now and free its blocks; its final output (``finish_reason`` ``reason``)
        comes from the next ``step``."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish_request(req, reason, report)
        self.counters["requests_aborted_total"] += 1
        return True

    def fail_all(self) -> list[RequestOutput]:
        """Finish every request with an error now, without the device (after ``WorkerDiedError``:
        no step can run); returns their final outputs."""
        self._launched = None
        for req in list(self.requests.values()):
            self._finish_request(req, "error")
        outputs, self._finished_outputs = self._finished_outputs, []
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._finished_outputs) or self._launched is not None

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; returns outputs of finished requests (and of streaming ones that moved).

        The mode is chosen once, at start-up: ``_step_sync``, or ``_step_launch_ahead``
        (``async_scheduling``, on under CUDA graphs). Each returns whether a batch went out.
        """
        started, waited = time.perf_counter(), self.runner.waited
        sched = self.scheduler.schedule()
        self.stats.count_schedule(sched, self.pool)
        return self._run_step(sched, started, waited)

    def drain(self) -> list[RequestOutput]:
        """Complete the step launched ahead, if one is still in flight, without planning another: a
        sequence that stopped on the token before it had a row launched, whose tokens nobody would
        read. The offline API calls it before it returns, so nothing is left on the device or pending.
        Returns the outputs that step brings (none where its requests all finished before)."""
        if self._launched is None:
            return []
        return self._run_step(SchedulerOutput(), time.perf_counter(), self.runner.waited)

    def _run_step(self, sched: SchedulerOutput, started: float, waited: float) -> list[RequestOutput]:
        """The step's batch through the mode's launch (an empty plan only completes the step in flight)."""
        outputs, self._finished_outputs = self._finished_outputs, []
        if not self._step_mode(sched, outputs):
            self.runner.idle()  # an idle engine is not a GPU waiting on the host
        outputs += self._finished_outputs
        self._finished_outputs = []
        self.stats.time_step(time.perf_counter() - started, self.runner.waited - waited)
        return outputs

    def _step_sync(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> bool:
        """Launch the batch and wait for its tokens."""
        batch, failed = self._assemble_or_fail(sched)
        if failed:
            self._fail(sched)
        elif batch is not None:
            launched = self._launch_or_fail(sched, batch)
            if launched is not None:
                outputs += self._complete_or_fail(launched)
        return batch is not None

    def _step_launch_ahead(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> bool:
        """Launch this step *before* waiting for the tokens of the step in flight: rows that compute
        them read them on the device (``PrevTokenFeed``), and the host checks them while the device
        already runs this step. A sequence that stops on such a token has computed one row for
        nothing, which is dropped."""
        prev, self._launched = self._launched, None  # taken first: a failure must not repeat
        if prev is not None:
            self.in_flight_tokens.drop_surely_finished(sched, self.max_model_len)
        batch, failed = self._assemble_or_fail(sched)
        if prev is not None and prev.sampling is not None:
            # grammar rows: the mask was filled in the matcher process since the tokens ahead of it
            # arrived; the sampling goes out just before this forward, which reads its tokens on the
            # device (after this step's assembly: the fill's accept and fill take most of a step)
            prev = self._sample_or_fail(prev)
            if prev is None and batch is not None:  # assembled with rows of the requests that failed
                self._put_back(sched)
                batch = None
        if batch is None:  # nothing to launch ahead of it: wait for its tokens now
            if prev is not None:
                outputs += self._complete_or_fail(prev)
            if failed:
                self._fail(sched)
            return False
        self._launched = self._launch_or_fail(sched, batch, prev)
        if prev is not None:  # launched ahead of it (or failed to): now wait for its tokens
            outputs += self._complete_or_fail(prev, launched_after=self._launched)
        return True

    def _assemble_or_fail(self, sched: SchedulerOutput) -> tuple[StepBatch | None, bool]:
        if not sched.scheduled:
            return None, False
        try:
            return self._assemble_batch(sched), False
        except WorkerDiedError:
            raise
        except Exception:
            log.exception("assembling the step failed; failing the requests in this batch")
            return None, True

    def _assemble_batch(self, sched: SchedulerOutput) -> StepBatch:
        """The step's inputs assembled (``step_inputs``); the runner plans the device side."""
        rows = self.modules.module_rows if self.modules.active else None
        return assemble_batch(sched, self.blocks, self.runner, rows, self._to_recover)

    def _fail(self, sched: SchedulerOutput) -> None:
        give_back(sched.drafts)
        self.blocks.step_failed()  # a hybrid's snapshots the step was to write: never restored
        for s in sched.scheduled:
            if s.seq.request.request_id in self.requests:
                self._finish_request(s.seq.request, "error")

    def _put_back(self, sched: SchedulerOutput) -> None:
        """Launch-ahead: the sampling of the step in flight failed after this step was planned and
        assembled, with rows fed from that step's tokens. Its requests failed (``_sample_or_fail``),
        as in sync mode; nothing of this step goes out, and its other sequences (admitted now, or not
        in the failed step) go back to the queue's front, their blocks freed (``Scheduler.put_back``)."""
        give_back(sched.drafts)
        self.blocks.step_failed()  # a hybrid's snapshots the step was to write: never restored
        self.scheduler.put_back([s.seq for s in sched.scheduled])  # not for lack of blocks: no preemption

    def _launch_or_fail(
        self, sched: SchedulerOutput, batch: StepBatch, ahead_of: LaunchedStep | None = None
    ) -> LaunchedStep | None:
        try:
            return self._launch(sched, batch, ahead_of)
        except WorkerDiedError:  # the engine itself is gone: no later step can run
            raise
        except Exception:  # a failure fails this batch's requests, not the engine
            log.exception("engine step failed; failing the requests in this batch")
            self._fail(sched)
            return None

    def _launch(
        self, sched: SchedulerOutput, batch: StepBatch, ahead_of: LaunchedStep | None
    ) -> LaunchedStep:
        """Forward and sampling of an assembled batch, issued without waiting for the device.

        The forward is issued first, so the device works while the host advances the sequences
        (computed tokens, prefix index, forks) and picks the rows to sample. ``ahead_of``: the
        launched step whose tokens are not on the host yet; rows that compute them read them on
        the device.
        """
        ids = take_recompute_ids(sched, self._to_recover)
        num_recompute_rows = len(ids)  # the recomputed module rows come first; nothing is sampled from them
        scheduled, pending = sched.scheduled, self.in_flight_tokens.pending
        dst, src = gather_token_ids(scheduled, ids, ahead_of, pending, self.counters)
        feed = PrevTokenFeed(dst, src, ahead_of.launch.tokens) if dst else None
        launch = self.runner.forward(ids, batch, sched.copies, feed)
        self.stats.count_step(batch.meta.stats, len(ids), self.model_config.num_hidden_layers)
        # prompt rows read before the sequences advance and the sampling takes the rows
        self.output_rules.collect(scheduled, num_recompute_rows, launch, self.runner, self.blocks)
        launched, rows, params, generators = self.in_flight_tokens.mark_launched(
            scheduled, num_recompute_rows, launch, self.blocks, self._fork_samples, sched.drafts
        )
        launched.sampling = (rows, params, generators)
        # launched ahead, a step whose rules read the tokens ahead of it on the host (a grammar's mask,
        # a multi-token bad word, a thinking budget within reach) samples at the next step instead
        if ahead_of is None or not self.rules.waits(launched.samplers, launched.indices, params):
            self._sample(launched)
        return launched

    def _sample(self, launched: LaunchedStep) -> None:
        """Issue a launched step's sampling under its rules' mask, ban and adjusts (a grammar's token
        mask, ``min_tokens``' stops, bad words, a thinking budget's forced end; logit bias, allowed
        tokens, penalties)."""
        rows, params, generators = launched.sampling
        launched.sampling = None
        mask, ban = self.rules.restrict(launched.samplers, launched.indices, params)
        adjust = self.rules.adjust(launched.sampled_seqs, params)
        self.runner.sample(launched.launch, rows, params, generators, mask, ban, adjust)

    def _sample_or_fail(self, launched: LaunchedStep) -> LaunchedStep | None:
        """Issue the sampling of a step launched ahead, whose rules waited for the tokens before it.
        Where the device had run all it was given (a host-bound step), its tokens follow in
        microseconds: they are waited for now (``_take_tokens``), before the next forward is issued."""
        try:
            idle = self.runner.device_idle()
            self._sample(launched)
            if idle:
                self._take_tokens(launched)
            return launched
        except WorkerDiedError:
            raise
        except Exception:
            log.exception("sampling failed; failing the requests in this batch")
            for req in launched.touched:
                if self.requests.get(req.request_id) is req:
                    self._finish_request(req, "error")
            return None

    def _take_tokens(self, launched: LaunchedStep) -> None:
        """Wait for a step's tokens now and give them to the rules, with the step's samplers as the
        guess of the next step's (most decode steps sample the same sequences): a grammar's next mask is
        then filled in the matcher process while the host issues the next forward, places these tokens
        and plans the step after, instead of only during the last two. A device still busy with the
        forward before would be left idle while the host waits, so a GPU-bound step does not come here."""
        launched.taken = TakenTokens(self.runner.wait(launched.launch))
        if launched.taken.result is not None:
            pending = self.in_flight_tokens.pending
            tokens = launched.taken.result.tokens
            self.rules.advance(launched.samplers, launched.indices, tokens, pending, launched.samplers)

    def _complete_or_fail(
        self, launched: LaunchedStep, launched_after: LaunchedStep | None = None
    ) -> list[RequestOutput]:
        try:
            return self._complete(launched, launched_after)
        except WorkerDiedError:
            raise
        except Exception:  # e.g. a device error surfacing at the sync: fail that step's requests
            log.exception("engine step failed; failing the requests in this batch")
            give_back({v.seq: v.num_drafts for v in launched.verified})
            for req in launched.touched:
                if self.requests.get(req.request_id) is req:
                    self._finish_request(req, "error")
            return []

    def _complete(
        self, launched: LaunchedStep, launched_after: LaunchedStep | None = None
    ) -> list[RequestOutput]:
        """Wait for a launched step's tokens; put them in place of the placeholders, check stops, report.

        ``launched_after``: the step launched after this one (launch-ahead). Its placeholders are
        hidden meanwhile, so texts, stop checks and outputs see the sequences as of this step.
        """
        hidden = self.in_flight_tokens.hide(launched_after)
        try:
            return self._place_and_report(launched, launched_after)
        finally:
            self.in_flight_tokens.unhide(hidden)

    def _place_and_report(
        self, launched: LaunchedStep, launched_after: LaunchedStep | None = None
    ) -> list[RequestOutput]:
        """Wait for the step's tokens and place them; outputs of requests that finished or stream."""
        taken = launched.taken
        result = taken.result if taken is not None else self.runner.wait(launched.launch)
        if result is not None:
            self._place_tokens(launched, result, launched_after)
        outputs: list[RequestOutput] = []
        interval = self.config.stream_interval
        for req in launched.touched:
            # ``req.is_finished`` runs a generator over the request's samples: asked only when its
            # last sample is finished, which it requires (a request always has a sample)
            seqs = req.sequences
            if seqs[-1].status is SeqStatus.FINISHED and req.is_finished:
                if self._retire(req):
                    outputs.append(self._output(req))
            elif req.stream and (not req.streamed or req.unreported >= interval * len(seqs)):
                req.streamed, req.unreported = True, 0
                outputs.append(self._output(req))
        return outputs

    def _place_tokens(
        self, launched: LaunchedStep, result: SampleResult, launched_after: LaunchedStep | None = None
    ) -> None:
        """The scheduler puts the tokens in place, checks stops and frees sequences that stopped.

        The request rules take the tokens first (grammar matchers); ``then``: ``launched_after``'s
        samplers where its sampling waits for these tokens, so a rule may start its work (a grammar
        mask's fill, in structured decoding's matcher process) to overlap all that follows here.
        """
        after = launched_after
        then = after.samplers if after is not None and after.sampling is not None else None
        pending = self.in_flight_tokens.pending
        if launched.taken is None:  # else the rules took them as they arrived (``_take_tokens``)
            self.rules.advance(launched.samplers, launched.indices, result.tokens, pending, then)
        self.scheduler.update_from_output(
            launched.samplers, launched.indices, result, pending,
            self.eos_ids, self.max_model_len, self.tokenizer, self.counters, self.launch_ahead,
        )  # fmt: skip
        if launched.verified:  # speculated sequences: their drafts kept while the samples agree
            place_verified(
                launched.verified, result, self.scheduler, self.eos_ids, self.max_model_len,
                self.tokenizer, self.counters,
            )  # fmt: skip

    def _fork_samples(self, seq: Sequence) -> list[Sequence]:
        """When sequence 0 of an n > 1 request finishes its prompt, split off the other samples."""
        req = seq.request
        if req.params.num_samples == 1 or req.forked:
            return [seq]
        req.forked = True
        out = [seq]
        for index in range(1, req.params.num_samples):
            tokens, positions = token_array(seq.token_ids), token_array(seq.positions)
            child = self.input_processor.new_sequence(req, index, tokens, positions)
            self.blocks.fork(seq, child)
            self.scheduler.add_running(child)
            out.append(child)
        return out

    # ---- finishing and outputs -----------------------------------------------------------------
    def _finish_request(self, req: Request, reason: str, report: bool = True) -> None:
        for seq in req.sequences:
            self.in_flight_tokens.drop(seq)  # its in-flight tokens will never be read
            if not seq.is_finished:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
        if not req.forked:  # ended before its prompt did: the samples not split off end empty
            first, end = req.sequences[0], req.num_prompt_tokens
            for index in range(len(req.sequences), req.params.num_samples):
                tokens, positions = token_array(first.token_ids[:end]), token_array(first.positions[:end])
                empty = self.input_processor.new_sequence(req, index, tokens, positions, samples=False)
                empty.status, empty.finish_reason = SeqStatus.FINISHED, reason
        req.forked = True  # no more samples will be split off
        self._retire(req)
        if report:
            self._finished_outputs.append(self._output(req))

    def _refuse(self, seq: Sequence, why: str) -> None:
        """End a request the scheduler can never start (``Scheduler._unstick``), saying why. Not while
        a step is in flight: its tokens may end the very sequence that preempted itself for a block
        (launch-ahead schedules before the tokens ahead of it are checked); the next step asks again."""
        if self._launched is not None:
            return
        log.warning("request %s ended: %s", seq.request.request_id, why)
        seq.request.error = why
        self._finish_request(seq.request, "error")

    def _fail_request(self, req: Request) -> None:
        self._finish_request(req, "error")

    def _retire(self, req: Request) -> bool:
        """Take a finished request out of the engine; False if it was already out (reported).

        The identity check matters with async scheduling: an aborted request's id may be reused by
        a new request before the old one's in-flight step completes.
        """
        if self.requests.get(req.request_id) is not req:
            return False
        del self.requests[req.request_id]
        self._to_recover.discard(req)
        self.output_rules.discard(req)
        if req.modules is not None and req.modules.blocks:  # the request's own hold on its modules
            self.modules.release(req.modules.blocks)
            req.modules.blocks = []
        self.cache_pins.retire(req)  # its cache breakpoints' blocks held for their TTLs
        req.finish_time = time.monotonic()
        self.counters["requests_finished_total"] += 1
        return True

    def _output(self, req: Request) -> RequestOutput:
        finished = req.request_id not in self.requests
        return request_output(req, self.tokenizer, finished, self.output_rules)


__all__ = ["PLACEHOLDER_TOKEN", "Engine"]

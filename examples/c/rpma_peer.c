/*
 * A peer written against librpma (Debian's librpma-dev), for rdmsg's interop tests with its
 * cm_pingpong example. It speaks cm_pingpong's protocol: the client sends first, the server
 * answers each message with what it received; the client's connection request carries
 * cm_pingpong's hello in its private data ("rdmsgcm1", size, exchanges), and the server's
 * accept answers with the same hello.
 *
 *   rpma_peer server ADDR PORT SIZE ITERS
 *   rpma_peer client ADDR PORT SIZE ITERS [DELAY_MS]
 *
 * DELAY_MS: how long the client waits between the connection and its first send (so that a
 * receiver is asleep when the message comes).
 *
 * librpma has no flag for solicited sends: every send of this peer is unsolicited, so a
 * receiver armed solicited-only is never woken by it.
 *
 * Prints "rpma_peer: end 0" and exits 0 when every exchange went both ways.
 */

#include <librpma.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define HELLO_LEN 20

static void hello(unsigned char *h, uint32_t size, uint64_t iters)
{
	memcpy(h, "rdmsgcm1", 8);
	memcpy(h + 8, &size, 4); /* little-endian hosts only, as the VM is */
	memcpy(h + 12, &iters, 8);
}

static int fail(const char *what, int ret)
{
	fprintf(stderr, "rpma_peer: %s failed: %d\n", what, ret);
	return 1;
}

/* Waits for the next successful completion on cq; its opcode in *opcode. */
static int next_wc(struct rpma_cq *cq, enum ibv_wc_opcode *opcode)
{
	struct ibv_wc wc;
	int ret;

	for (;;) {
		ret = rpma_cq_get_wc(cq, 1, &wc, NULL);
		if (ret == 0)
			break;
		if (ret != RPMA_E_NO_COMPLETION)
			return fail("rpma_cq_get_wc", ret);
		ret = rpma_cq_wait(cq);
		if (ret)
			return fail("rpma_cq_wait", ret);
	}
	if (wc.status != IBV_WC_SUCCESS) {
		fprintf(stderr, "rpma_peer: completion failed: %s\n", ibv_wc_status_str(wc.status));
		return 1;
	}
	*opcode = wc.opcode;
	return 0;
}

int main(int argc, char **argv)
{
	if (argc < 6 || argc > 7 || (strcmp(argv[1], "server") && strcmp(argv[1], "client"))) {
		fprintf(stderr, "usage: %s server|client ADDR PORT SIZE ITERS [DELAY_MS]\n", argv[0]);
		return 2;
	}
	int server = strcmp(argv[1], "server") == 0;
	const char *addr = argv[2], *port = argv[3];
	uint32_t size = (uint32_t)strtoul(argv[4], NULL, 10);
	uint64_t iters = strtoull(argv[5], NULL, 10);
	unsigned long delay_ms = argc == 7 ? strtoul(argv[6], NULL, 10) : 0;
	struct ibv_context *ctx = NULL;
	struct rpma_peer *peer = NULL;
	struct rpma_ep *ep = NULL;
	struct rpma_conn_req *req = NULL;
	struct rpma_conn *conn = NULL;
	struct rpma_mr_local *mr = NULL;
	struct rpma_cq *cq = NULL;
	enum rpma_conn_event event;
	unsigned char ours[HELLO_LEN];
	struct rpma_conn_private_data pdata = {ours, HELLO_LEN}, theirs = {NULL, 0};
	int ret;

	if (size == 0 || size > (1 << 20) || iters == 0)
		return fail("checking SIZE and ITERS", -1);
	hello(ours, size, iters);
	ret = rpma_utils_get_ibv_context(addr, RPMA_UTIL_IBV_CONTEXT_LOCAL, &ctx);
	if (ret)
		return fail("rpma_utils_get_ibv_context", ret);
	ret = rpma_peer_new(ctx, &peer);
	if (ret)
		return fail("rpma_peer_new", ret);
	/* Two buffers: [0, size) to receive into, [size, 2 size) to send from. */
	unsigned char *buf = calloc(2, size);
	if (!buf)
		return fail("calloc", -1);
	ret = rpma_mr_reg(peer, buf, 2 * (size_t)size, RPMA_MR_USAGE_SEND | RPMA_MR_USAGE_RECV, &mr);
	if (ret)
		return fail("rpma_mr_reg", ret);

	if (server) {
		ret = rpma_ep_listen(peer, addr, port, &ep);
		if (ret)
			return fail("rpma_ep_listen", ret);
		printf("rpma_peer: listening on %s:%s\n", addr, port);
		fflush(stdout);
		ret = rpma_ep_next_conn_req(ep, NULL, &req);
		if (ret)
			return fail("rpma_ep_next_conn_req", ret);
	} else {
		ret = rpma_conn_req_new(peer, addr, port, NULL, &req);
		if (ret)
			return fail("rpma_conn_req_new", ret);
	}
	/* A receive posted before the connection is up: the peer may send at once. */
	ret = rpma_conn_req_recv(req, mr, 0, size, NULL);
	if (ret)
		return fail("rpma_conn_req_recv", ret);
	ret = rpma_conn_req_connect(&req, &pdata, &conn);
	if (ret)
		return fail("rpma_conn_req_connect", ret);
	ret = rpma_conn_next_event(conn, &event);
	if (ret || event != RPMA_CONN_ESTABLISHED)
		return fail("waiting for RPMA_CONN_ESTABLISHED", ret ? ret : (int)event);
	/* The peer's private data: its request's (server) or its accept's (client). */
	ret = rpma_conn_get_private_data(conn, &theirs);
	if (ret)
		return fail("rpma_conn_get_private_data", ret);
	int rdmsg_peer = theirs.ptr && theirs.len >= HELLO_LEN && memcmp(theirs.ptr, "rdmsgcm1", 8) == 0;
	printf("rpma_peer: connected; the peer's private data is %s\n",
	       rdmsg_peer ? "cm_pingpong's hello" : "not a hello");
	fflush(stdout);
	ret = rpma_conn_get_cq(conn, &cq);
	if (ret)
		return fail("rpma_conn_get_cq", ret);
	if (delay_ms)
		usleep(delay_ms * 1000);
	/* The server's send completion and the client's next message are not ordered: a
	 * receive that completes early counts for the next exchange. */
	int early_recv = 0;

	for (uint64_t i = 0; i < iters; i++) {
		enum ibv_wc_opcode op;
		int got_recv = early_recv, got_send = 0;

		early_recv = 0;
		if (!server) {
			memset(buf + size, 0x5a, size);
			memcpy(buf + size, &i, size < 8 ? size : 8);
			ret = rpma_send(conn, mr, size, size, RPMA_F_COMPLETION_ALWAYS, NULL);
			if (ret)
				return fail("rpma_send", ret);
			/* The next receive is posted once this one's completion is in. */
		}
		while (!got_recv || (!server && !got_send)) {
			if (next_wc(cq, &op))
				return 1;
			if (op == IBV_WC_RECV)
				got_recv = 1;
			else if (op == IBV_WC_SEND)
				got_send = 1;
		}
		if (!server && memcmp(buf, buf + size, size) != 0 && rdmsg_peer) {
			fprintf(stderr, "rpma_peer: exchange %llu: the echo differs\n",
				(unsigned long long)i);
			return 1;
		}
		if (server)
			memcpy(buf + size, buf, size);
		if (i + 1 < iters || server) {
			ret = rpma_recv(conn, mr, 0, size, NULL);
			if (ret)
				return fail("rpma_recv", ret);
		}
		if (server) {
			ret = rpma_send(conn, mr, size, size, RPMA_F_COMPLETION_ALWAYS, NULL);
			if (ret)
				return fail("rpma_send", ret);
			got_send = 0;
			while (!got_send) {
				if (next_wc(cq, &op))
					return 1;
				if (op == IBV_WC_SEND)
					got_send = 1;
				else if (op == IBV_WC_RECV)
					early_recv = 1;
			}
		}
	}
	printf("rpma_peer: %llu exchanges of %u bytes\n", (unsigned long long)iters, size);

	if (server) {
		/* The client disconnects once it has its last answer. */
		ret = rpma_conn_next_event(conn, &event);
		if (ret)
			return fail("waiting for RPMA_CONN_CLOSED", ret);
		(void)rpma_conn_disconnect(conn);
	} else {
		ret = rpma_conn_disconnect(conn);
		if (ret)
			return fail("rpma_conn_disconnect", ret);
		ret = rpma_conn_next_event(conn, &event);
		if (ret)
			return fail("waiting for RPMA_CONN_CLOSED", ret);
	}
	(void)rpma_conn_delete(&conn);
	(void)rpma_mr_dereg(&mr);
	if (ep)
		(void)rpma_ep_shutdown(&ep);
	(void)rpma_peer_delete(&peer);
	free(buf);
	printf("rpma_peer: end 0\n");
	return 0;
}

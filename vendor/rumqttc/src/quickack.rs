//! bucketd patch: a TCP stream that acknowledges what it has read at once (`TCP_QUICKACK`,
//! re-armed after every read, as Linux clears it), for [`NetworkOptions::set_tcp_quickack`].
//!
//! Why: a client that acknowledges MQTT messages in batches (after a commit) sends nothing for a
//! while after a burst, so its kernel's delayed ACK (40 ms and more) is the only thing that
//! acknowledges the burst's last TCP segment; a broker with Nagle's algorithm on (Mosquitto's
//! default) holds its next small packets until that ACK arrives. Quick ACKs after each read end
//! that wait. Elsewhere than Linux the stream is the plain socket.
//!
//! [`NetworkOptions::set_tcp_quickack`]: crate::NetworkOptions::set_tcp_quickack

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

pub(crate) struct QuickAck {
    inner: TcpStream,
    enabled: bool,
}

impl QuickAck {
    pub(crate) fn new(inner: TcpStream, enabled: bool) -> Self {
        QuickAck { inner, enabled }
    }

    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn rearm(&self) {
        if self.enabled {
            // Best effort: a socket that refuses the option just keeps delayed ACKs.
            let _ = socket2::SockRef::from(&self.inner).set_quickack(true);
        }
    }

    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    fn rearm(&self) {}
}

impl AsyncRead for QuickAck {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.rearm();
        }
        polled
    }
}

impl AsyncWrite for QuickAck {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(all(test, any(target_os = "linux", target_os = "android")))]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A read through an enabled stream leaves the socket in quick-ACK mode, even after the
    /// client wrote in between (which is what puts Linux back into delayed ACKs); the bytes pass
    /// unchanged, both ways. Disabled, the socket is left to the kernel.
    #[tokio::test]
    async fn a_read_rearms_quick_acks_and_passes_bytes_unchanged() {
        for enabled in [true, false] {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
            let mut client = QuickAck::new(client.unwrap(), enabled);
            let (mut broker, _) = accepted.unwrap();
            let mut got = [0u8; 5];
            for round in 0..3u8 {
                broker.write_all(&[round; 5]).await.unwrap();
                client.read_exact(&mut got).await.unwrap();
                assert_eq!(got, [round; 5]);
                if enabled {
                    let sock = socket2::SockRef::from(&client.inner);
                    assert!(sock.quickack().unwrap(), "round {round}: quick ACKs re-armed");
                }
                client.write_all(b"ack").await.unwrap();
                let mut echo = [0u8; 3];
                broker.read_exact(&mut echo).await.unwrap();
                assert_eq!(&echo, b"ack");
            }
        }
    }
}
